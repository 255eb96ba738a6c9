"""Row formats: detect which one a dataset uses, and turn rows into token ids with a loss mask.

- `text`: every token is a target.
- `prompt_completion`: prompt and completion are tokenized separately and joined; only completion tokens are targets.
- `messages`: the conversation is rendered with the tokenizer's chat template (with the row's tool definitions, when
  it has them); only the text each assistant turn adds (its content, tool calls and the template's end-of-turn text)
  is a target.

Documents then get BOS in front (if the tokenizer has one and it is not already there; never a target) and EOS at the
end (same rule; it is a target exactly when the token before it is).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from remat.data.config import DatasetConfig
from remat.data.encode import GROUP_CHARS, GROUP_TEXTS, encode_texts
from remat.data.sources import RawRow
from remat.errors import ConfigError

logger = logging.getLogger(__name__)

@dataclass
class EncodedDocument:
    """Token ids of one document (int32) and, per token, whether it is a loss target (bool); lists are converted."""

    input_ids: np.ndarray
    loss_mask: np.ndarray

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, dtype=np.int32)
        self.loss_mask = np.asarray(self.loss_mask, dtype=bool)
        if self.input_ids.shape != self.loss_mask.shape or self.input_ids.ndim != 1:
            raise ValueError(f"ids and mask must be equal 1-d arrays; got {self.input_ids.shape} and "
                             f"{self.loss_mask.shape}")


def format_fields(cfg: DatasetConfig) -> dict[str, tuple[str, ...]]:
    """The fields each concrete format needs, with the field names configured in `cfg`."""
    return {
        "messages": (cfg.messages_field,),
        "prompt_completion": (cfg.prompt_field, cfg.completion_field),
        "text": (cfg.text_field,),
    }


def _describe_fields(fields: tuple[str, ...]) -> str:
    return " and ".join(repr(name) for name in fields)


def detect_format(cfg: DatasetConfig, first: RawRow, *, key_prefix: str = "dataset") -> str:
    """`cfg.format`, or for "auto" the first format (messages, prompt_completion, text) whose fields `first` has."""
    if cfg.format != "auto":
        return cfg.format
    for name, fields in format_fields(cfg).items():
        if all(field in first.data for field in fields):
            return name
    expected = "; ".join(f"{_describe_fields(fields)} for {name}" for name, fields in format_fields(cfg).items())
    raise ConfigError(
        f"{key_prefix}.format: cannot detect the format of {first.where} (keys: {sorted(first.data)}); "
        f"expected {expected}. Set {key_prefix}.format and the {key_prefix}.*_field keys"
    )


def _field(row: RawRow, name: str, fmt: str, cfg: DatasetConfig, key_prefix: str) -> Any:
    if name not in row.data:
        needed = _describe_fields(format_fields(cfg)[fmt])
        raise ConfigError(
            f"{key_prefix}.path: {row.where} has no field {name!r} (keys: {sorted(row.data)}); "
            f"format {fmt!r} expects {needed}"
        )
    return row.data[name]


def _string_field(row: RawRow, name: str, fmt: str, cfg: DatasetConfig, key_prefix: str) -> str:
    value = _field(row, name, fmt, cfg, key_prefix)
    if not isinstance(value, str):
        raise ConfigError(
            f"{key_prefix}.path: {row.where} field {name!r} must be a string for format {fmt!r}, "
            f"got {type(value).__name__}"
        )
    return value


#: The keys of a message that reach the chat template besides ``role`` and ``content``: an assistant turn's tool calls
#: and reasoning, a tool turn's call id and name (OpenAI's chat-completions schema, which chat templates render).
MESSAGE_KEYS: tuple[str, ...] = ("tool_calls", "reasoning_content", "tool_call_id", "name")


def _messages_field(row: RawRow, cfg: DatasetConfig, key_prefix: str) -> list[dict[str, Any]]:
    value = _field(row, cfg.messages_field, "messages", cfg, key_prefix)
    problem = None
    if not isinstance(value, list) or not value:
        problem = f"got {type(value).__name__ if not isinstance(value, list) else 'an empty list'}"
    else:
        for index, message in enumerate(value):
            problem = _message_problem(index, message)
            if problem:
                break
    if problem:
        raise ConfigError(
            f"{key_prefix}.path: {row.where} field {cfg.messages_field!r} must be a non-empty list of "
            f"{{'role': str, 'content': str}} objects; {problem}"
        )
    return [{"role": m["role"], "content": m.get("content") or "",
             **{key: m[key] for key in MESSAGE_KEYS if m.get(key) is not None}} for m in value]


def _message_problem(index: int, message: Any) -> str | None:
    if not isinstance(message, dict):
        return f"message {index} is a {type(message).__name__}"
    calls = message.get("tool_calls")
    if calls is not None and (message.get("role") != "assistant" or not isinstance(calls, list) or not all(
            isinstance(call, dict) and isinstance(call.get("function"), dict)
            and isinstance(call["function"].get("name"), str) for call in calls)):
        return (f"message {index} has tool_calls {calls!r}; allowed on an assistant turn: a list of "
                "{'type': 'function', 'function': {'name': str, 'arguments': ...}}")
    content_ok = isinstance(message.get("content"), str) or (calls and message.get("content") is None)
    if not isinstance(message.get("role"), str) or not content_ok:
        return f"message {index} has keys {sorted(message)} (role and content must be strings)"
    return None


def row_tools(row: RawRow, cfg: DatasetConfig, key_prefix: str) -> list[dict[str, Any]] | None:
    """The tool definitions a row offers (its ``cfg.tools_field``: a list of OpenAI function schemas, or that list
    as JSON text), rendered with its conversation; None when it has none."""
    value = row.data.get(cfg.tools_field)
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except ValueError as err:
            raise ConfigError(f"{key_prefix}.path: {row.where} field {cfg.tools_field!r} is not JSON ({err}); "
                              "allowed: a list of tool schemas, or that list as JSON text") from None
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise ConfigError(f"{key_prefix}.path: {row.where} field {cfg.tools_field!r} must be a list of tool schemas "
                          f"({{'type': 'function', 'function': {{...}}}}); got {type(value).__name__}")
    return value


def _encode_text(
    rows: Sequence[RawRow], cfg: DatasetConfig, tok: PreTrainedTokenizerBase, kp: str
) -> list[EncodedDocument]:
    texts = [_string_field(row, cfg.text_field, "text", cfg, kp) for row in rows]
    return [EncodedDocument(e.ids, np.ones(len(e.ids), dtype=bool)) for e in encode_texts(tok, texts)]


def _encode_prompt_completion(
    rows: Sequence[RawRow], cfg: DatasetConfig, tok: PreTrainedTokenizerBase, kp: str
) -> list[EncodedDocument]:
    prompts = [_string_field(row, cfg.prompt_field, "prompt_completion", cfg, kp) for row in rows]
    completions = [_string_field(row, cfg.completion_field, "prompt_completion", cfg, kp) for row in rows]
    return [
        EncodedDocument(np.concatenate([p.ids, c.ids]),
                        np.concatenate([np.zeros(len(p.ids), dtype=bool), np.ones(len(c.ids), dtype=bool)]))
        for p, c in zip(encode_texts(tok, prompts), encode_texts(tok, completions), strict=True)
    ]


def assistant_spans(
    tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], *, where: str = "", key_prefix: str = "dataset",
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span each assistant turn adds to it.

    A turn's span runs from the end of the rendering of the turns before it (with the generation prompt) to the end
    of the rendering that includes it, so it holds the assistant content and the template's end-of-turn text.
    Renders go through transformers' own jinja renderer, which (unlike `apply_chat_template`) accepts the empty
    conversation that precedes a leading assistant turn. ``tools`` (tool schemas) are rendered with every prefix, as
    the template places them (in the system turn, most often).
    """
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    conversations = [messages] + [messages[:i] for i in turns] + [messages[: i + 1] for i in turns]
    generation_prompt = [False] + [True] * len(turns) + [False] * len(turns)
    try:
        template = tok.get_chat_template()
        rendered = [
            render_jinja_template(
                conversations=[conversation],
                chat_template=template,
                tools=tools,
                add_generation_prompt=prompt,
                **tok.special_tokens_map,
            )[0][0]
            for conversation, prompt in zip(conversations, generation_prompt, strict=True)
        ]
    except Exception as exc:  # jinja raises many kinds of errors, including the template's own raise_exception
        raise ConfigError(f"{key_prefix}.path: {where}: the chat template failed to render this row: {exc}") from exc
    full, befores, throughs = rendered[0], rendered[1 : 1 + len(turns)], rendered[1 + len(turns) :]
    spans: list[tuple[int, int]] = []
    for before, through in zip(befores, throughs, strict=True):
        if not (full.startswith(before) and full.startswith(through) and len(before) <= len(through)):
            raise ConfigError(
                f"{key_prefix}.path: {where}: the tokenizer's chat template does not render this conversation "
                "turn by turn (a rendering of the first turns is not a prefix of the whole), so assistant "
                "tokens cannot be located; use a template that appends each turn"
            )
        spans.append((len(before), len(through)))
    return full, spans


def _encode_messages(
    rows: Sequence[RawRow], cfg: DatasetConfig, tok: PreTrainedTokenizerBase, kp: str
) -> list[EncodedDocument]:
    if getattr(tok, "chat_template", None) is None:
        raise ConfigError(
            f"{kp}.format: 'messages' needs a tokenizer with a chat template; the tokenizer in use has none "
            "(use the builtin tokenizer or set tokenizer.path to one with a chat template)"
        )
    if not tok.is_fast:
        raise ConfigError(
            f"{kp}.format: 'messages' needs a fast tokenizer (character offsets); got {type(tok).__name__}"
        )
    conversations = [(_messages_field(row, cfg, kp), row_tools(row, cfg, kp), row.where) for row in rows]
    if cfg.agent_chat is not None and cfg.agent_chat.truncate_history:
        conversations = [(_fit_history(tok, messages, tools, cfg.seq_length), tools, where)
                         for messages, tools, where in conversations]
    rendered = [assistant_spans(tok, messages, where=where, key_prefix=kp, tools=tools)
                for messages, tools, where in conversations]
    documents = []
    for (_, spans), encoded in zip(rendered, encode_texts(tok, [text for text, _ in rendered], offsets=True),
                                   strict=True):
        starts = encoded.starts
        assert starts is not None  # offsets=True
        mask = np.zeros(len(starts), dtype=bool)
        for lo, hi in spans:
            mask |= (starts >= lo) & (starts < hi)
        documents.append(EncodedDocument(encoded.ids, mask))
    return documents


def _framed_length(tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None) -> int:
    """The tokens of the conversation's document: its rendering, framed with BOS and EOS (`add_document_specials`)."""
    text = render_jinja_template(conversations=[messages], chat_template=tok.get_chat_template(), tools=tools,
                                 **tok.special_tokens_map)[0][0]
    ids = encode_texts(tok, [text])[0].ids
    return len(add_document_specials(EncodedDocument(ids, np.zeros(len(ids), dtype=bool)), tok).input_ids)


def _fit_history(tok: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 seq_length: int) -> list[dict[str, Any]]:
    """``messages`` without its oldest exchanges (cut at user turns; leading system turns kept) until its document
    fits ``seq_length`` tokens (``agent_chat.truncate_history``, NeMo's rule); the last exchange when none fits."""
    if _framed_length(tok, messages, tools) <= seq_length:
        return messages
    leading = next((i for i, message in enumerate(messages) if message["role"] != "system"), len(messages))
    system, history = messages[:leading], messages[leading:]
    starts = [i for i, message in enumerate(history) if message["role"] == "user"]
    for start in starts:
        if _framed_length(tok, system + history[start:], tools) <= seq_length:
            return system + history[start:]
    return system + history[starts[-1]:] if starts else messages


def _encode_tokens(
    rows: Sequence[RawRow], cfg: DatasetConfig, tok: PreTrainedTokenizerBase, kp: str
) -> list[EncodedDocument]:
    """Rows already token ids (``input_ids``, with ``labels`` of -100 where no loss is wanted, else every token a
    target), checked against the tokenizer's vocabulary, which sizes the model's embeddings."""
    documents = []
    for row in rows:
        ids, labels = row.data.get("input_ids"), row.data.get("labels")
        vocabulary = len(tok)
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < vocabulary for i in ids)):
            raise ConfigError(f"{kp}.format: 'tokens' needs {row.where} to hold input_ids, a non-empty list of token "
                              f"ids from 0 to {vocabulary - 1} (the tokenizer's vocabulary)")
        if labels is not None and (not isinstance(labels, list) or len(labels) != len(ids)):
            raise ConfigError(f"{kp}.format: {row.where} has labels that are not a list as long as its input_ids")
        mask = [True] * len(ids) if labels is None else [label != -100 for label in labels]
        documents.append(EncodedDocument(ids, mask))
    return documents


_ENCODERS = {"text": _encode_text, "prompt_completion": _encode_prompt_completion, "messages": _encode_messages,
             "tokens": _encode_tokens}


def add_document_specials(document: EncodedDocument, tokenizer: PreTrainedTokenizerBase) -> EncodedDocument:
    """BOS in front (never a target) and EOS at the end (a target iff the token before it is), unless present."""
    ids, mask = document.input_ids, document.loss_mask.copy()
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    head: list[tuple[int, bool]] = []
    tail: list[tuple[int, bool]] = []
    if bos is not None and (not len(ids) or ids[0] != bos):
        head.append((bos, False))
    elif len(ids) and ids[0] == bos:
        mask[0] = False
    if eos is not None and (not len(ids) or ids[-1] != eos):
        tail.append((eos, bool(len(mask)) and bool(mask[-1])))
    if not head and not tail:
        return EncodedDocument(ids, mask)
    return EncodedDocument(
        np.concatenate([np.array([i for i, _ in head], np.int32), ids, np.array([i for i, _ in tail], np.int32)]),
        np.concatenate([np.array([m for _, m in head], bool), mask, np.array([m for _, m in tail], bool)]),
    )


def _row_groups(rows: Iterable[RawRow]) -> Iterator[list[RawRow]]:
    """`rows` in groups of at most `GROUP_TEXTS` rows and about `GROUP_CHARS` characters of string fields, so that
    only one group's raw text is held while it is encoded."""
    group: list[RawRow] = []
    chars = 0
    for row in rows:
        group.append(row)
        chars += sum(len(value) for value in row.data.values() if isinstance(value, str))
        if chars >= GROUP_CHARS or len(group) >= GROUP_TEXTS:
            yield group
            group, chars = [], 0
    if group:
        yield group


def encode_rows(
    rows: Iterable[RawRow],
    fmt: str,
    cfg: DatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    key_prefix: str = "dataset",
) -> list[EncodedDocument]:
    """Tokenize `rows` in format `fmt` and frame each document with BOS/EOS. Rows are consumed a group at a time and
    long texts are tokenized in pieces (`remat.data.encode`), so memory stays near the size of the token ids."""
    documents: list[EncodedDocument] = []
    drop_longer = cfg.agent_chat is not None and cfg.agent_chat.filter_overlong
    dropped = 0
    for group in _row_groups(rows):
        encoded = _ENCODERS[fmt](group, cfg, tokenizer, key_prefix)
        group.clear()
        framed = encoded if fmt == "tokens" else [add_document_specials(document, tokenizer) for document in encoded]
        kept = [document for document in framed if not (drop_longer and len(document.input_ids) > cfg.seq_length)]
        dropped += len(framed) - len(kept)
        documents.extend(kept)
    if dropped:
        logger.info("%s: dropped %d traces longer than seq_length %d (agent_chat.filter_overlong)", key_prefix,
                    dropped, cfg.seq_length)
    return documents
