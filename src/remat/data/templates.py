"""Row templates: how a raw row of a question-answering or multiple-choice dataset becomes a prompt and an answer
(`dataset.template`), in the layouts NeMo AutoModel's dataset builders use, so that a recipe written for them trains
on the same text:

- ``squad`` (SQuAD rows: ``context``, ``question``, ``answers.text``): ``Context: {context} Question: {question}
  Answer: `` and the first answer, stripped;
- ``hellaswag`` (``ctx``, ``endings``, ``label``): the context and the labelled ending, joined as they are;
- ``columns`` (``column_mapping`` names the columns of the roles ``context``, ``question``, ``answer``): the context
  and the question joined by a space, and the answer.

The loss is on the answer only. With a chat template (the tokenizer's, unless ``use_chat_template: false``) the row is
a conversation instead: ``squad`` one user turn with the prompt and the assistant's answer; ``columns`` a system turn
with the context, a user turn with the question, the assistant's answer (``hellaswag`` is never a chat, as in NeMo).

Two templates make conversations with tool calls (always a chat; the loss on the assistant turns, tool calls
included), rendered with the row's tool definitions:

- ``agent_chat`` (NeMo's ``make_agent_chat_dataset``): a ``messages`` list in OpenAI's schema or in chatml's with
  ``tool_call`` / ``tool_response`` turns, or a ShareGPT ``conversations`` list (``human``, ``gpt``,
  ``function_call``, ``observation``), with ``tools``; see NOTE [ Agent traces as OpenAI messages ];
- ``xlam`` (Salesforce's xLAM function-calling rows: ``query``, ``tools``, ``answers``): the query as a user turn and
  the answers as one assistant turn of tool calls; the tools' parameters become JSON schemas (a parameter without a
  default is required).

# NOTE [ The prompt's trailing space belongs to the answer ]
# The templates end the prompt with a space ("... Answer: "). remat tokenizes prompt and answer apart (the loss mask
# is exact at their boundary); a prompt ending in a space would make the space a token of its own and the answer's
# first word a word without its leading space, which is not how the joined text tokenizes. So the prompt's trailing
# whitespace moves to the front of the answer: the strings joined are the template's, the first answer word
# tokenizes as in the joined text, and it is a target.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from remat.data.config import TOOL_TEMPLATES, AgentChatOptions, DatasetConfig
from remat.data.sources import RawRow
from remat.errors import ConfigError

PROMPT, COMPLETION, MESSAGES, TOOLS = "prompt", "completion", "messages", "tools"


def apply_template(rows: Iterator[RawRow], cfg: DatasetConfig, *, chat: bool,
                   key_prefix: str = "dataset") -> tuple[Iterator[RawRow], str]:
    """``rows`` as the prompt/completion (or, with ``chat``, messages) rows of ``cfg.template``, and that format."""
    assert cfg.template is not None
    template = cfg.template
    chat = chat and template != "hellaswag"
    make: Callable[[Mapping[str, Any], str], dict[str, Any]]
    if template in TOOL_TEMPLATES and not chat:
        raise ConfigError(f"{key_prefix}.template: {template!r} makes conversations with tool calls, which need a chat "
                          "template; allowed: a tokenizer with one (or chat_template: FILE), use_chat_template unset")
    if template == "squad":
        make = _squad_chat if chat else _squad
    elif template == "hellaswag":
        make = _hellaswag
    elif template == "xlam":
        make = _xlam
    elif template == "agent_chat":
        options = cfg.agent_chat or AgentChatOptions()

        def make(data: Mapping[str, Any], where: str) -> dict[str, Any]:
            return _agent_chat(data, options)
    else:
        mapping = dict(cfg.column_mapping or {})

        def make(data: Mapping[str, Any], where: str) -> dict[str, Any]:
            return _columns(data, where, mapping, chat)

    def mapped() -> Iterator[RawRow]:
        for row in rows:
            try:
                yield RawRow(make(row.data, row.where), row.where)
            except (KeyError, IndexError, TypeError, ValueError) as err:
                raise ConfigError(f"{key_prefix}.template: {row.where} does not have the {template!r} layout "
                                  f"({_why(err)}; keys: {sorted(row.data)}); {_LAYOUTS[template]}") from None

    return mapped(), MESSAGES if chat else "prompt_completion"


_LAYOUTS: dict[str, str] = {
    "squad": "allowed: rows with 'context', 'question' and 'answers' {'text': [...]} (SQuAD's)",
    "hellaswag": "allowed: rows with 'ctx', 'endings' (a list) and 'label' (an index into it) (HellaSwag's)",
    "columns": "allowed: rows with the string columns column_mapping names",
    "agent_chat": "allowed: rows with 'messages' (OpenAI's or chatml's roles) or 'conversations' (ShareGPT's), and "
                  "optionally 'tools'",
    "xlam": "allowed: rows with 'query', 'tools' and 'answers' (xLAM's; tools and answers as lists or JSON text)",
}


def _why(err: Exception) -> str:
    if isinstance(err, KeyError):
        return f"no field {err.args[0]!r}"
    return f"{type(err).__name__}: {err}"


def _prompt_and_answer(prompt: str, answer: str) -> dict[str, str]:
    """NOTE [ The prompt's trailing space belongs to the answer ]."""
    kept = prompt.rstrip()
    return {PROMPT: kept, COMPLETION: prompt[len(kept):] + answer}


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} is {type(value).__name__}, not text")
    return value


def _squad_answer(data: Mapping[str, Any]) -> str:
    texts = data["answers"]["text"]
    return _text(texts[0], "answers.text[0]").strip() if texts else ""


def _squad(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    prompt = f"Context: {_text(data['context'], 'context')} Question: {_text(data['question'], 'question')} Answer: "
    return _prompt_and_answer(prompt, _squad_answer(data))


def _squad_chat(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    context, question = data.get("context") or "", data.get("question") or ""
    prompt = f"Context: {_text(context, 'context')} Question: {_text(question, 'question')} Answer: "
    return {MESSAGES: [{"role": "user", "content": prompt},
                       {"role": "assistant", "content": _squad_answer(data)}]}


def _hellaswag(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    endings = data["endings"]
    if not isinstance(endings, list):
        raise TypeError(f"endings is {type(endings).__name__}, not a list")
    label = int(data["label"])
    if not 0 <= label < len(endings):
        raise IndexError(f"label {label} is not an index into {len(endings)} endings")
    return {PROMPT: _text(data["ctx"], "ctx"), COMPLETION: _text(endings[label], f"endings[{label}]")}


def _columns(data: Mapping[str, Any], where: str, mapping: dict[str, str], chat: bool) -> dict[str, Any]:
    role = {name: _text(data[column], column) if data[column] is not None else None
            for name, column in mapping.items()}
    context, question, answer = role.get("context"), role.get("question"), role["answer"]
    if answer is None:
        raise TypeError(f"{mapping['answer']} (the answer) is null")
    if chat:
        return {MESSAGES: [{"role": "system", "content": context or ""}, {"role": "user", "content": question or ""},
                           {"role": "assistant", "content": answer}]}
    return _prompt_and_answer(" ".join(part for part in (context, question, "") if part is not None), answer)


# ------------------------------------------------------------------------------------------------ tool calls

#: ShareGPT's ``from`` -> chatml's role (NeMo's agent traces).
_SHAREGPT_ROLES: dict[str, str] = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "function_call": "tool_call", "tool_call": "tool_call",
    "observation": "tool_response", "tool_response": "tool_response", "tool": "tool_response",
}
_ROLES = frozenset({"system", "user", "assistant", "tool_call", "tool_response", "tool"})


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def _arguments(value: Any) -> str:
    """A call's arguments as the JSON text OpenAI's schema holds."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# NOTE [ Agent traces as OpenAI messages ]
# A trace becomes the messages chat templates render. Consecutive ``tool_call`` turns (their content a JSON call) are
# one assistant turn of parallel tool calls, attached to the assistant turn just before when that one has text and no
# calls (one turn, as a model emits reasoning and a call together); the ``tool_response`` / ``tool`` turns after them
# answer those calls in order (``tool_call_id`` theirs when given). An OpenAI assistant turn keeps its ``tool_calls``
# (arguments made JSON text, missing ids numbered) and its ``reasoning_content``. Call ids are ``call_{id}_{n}`` over
# the row's ``id`` (``call_{n}`` without one), numbered through the trace: what NeMo's builder renders, so that a
# template that prints ids sees the same text.
def _agent_chat(data: Mapping[str, Any], options: AgentChatOptions) -> dict[str, Any]:
    turns = data.get("messages")
    if turns is None:
        turns = [{"role": _SHAREGPT_ROLES[turn["from"]], "content": turn.get("value", ""),
                  **({"reasoning_content": turn["reasoning_content"]} if turn.get("reasoning_content") else {})}
                 for turn in data["conversations"]]
    if not isinstance(turns, list):
        raise TypeError(f"messages is {type(turns).__name__}, not a list")
    if options.trim_incomplete_last_turn:
        last = max((i for i, turn in enumerate(turns) if turn.get("role") == "assistant"), default=len(turns) - 1)
        turns = turns[: last + 1]
    messages = _TraceConverter(data.get("id")).convert(turns)
    if options.drop_history_reasoning_content:
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        for i, message in enumerate(messages):
            if i != last and message["role"] == "assistant":
                message.pop("reasoning_content", None)
    return {MESSAGES: messages, TOOLS: data.get("tools")}


class _TraceConverter:
    """NOTE [ Agent traces as OpenAI messages ], for one row."""

    def __init__(self, row_id: Any) -> None:
        self.prefix = f"call_{row_id}" if row_id is not None else "call"
        self.count = 0
        self.pending: list[str] = []

    def _call(self, name: Any, arguments: Any, call_id: Any = None) -> dict[str, Any]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool call without a name ({name!r})")
        if not isinstance(call_id, str) or not call_id:
            call_id = f"{self.prefix}_{self.count}"
        self.count += 1
        self.pending.append(call_id)
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": _arguments(arguments)}}

    def convert(self, turns: list[Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        answered = 0
        for index, turn in enumerate(turns):
            role = turn.get("role")
            if role not in _ROLES:
                raise ValueError(f"role {role!r} is not one of {sorted(_ROLES)}")
            content = turn.get("content")
            if role == "tool_call":
                if index == 0 or turns[index - 1].get("role") != "tool_call":  # a new group of parallel calls
                    self.pending, answered = [], 0
                    if out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1]:
                        out[-1]["tool_calls"] = []
                    else:
                        out.append({"role": "assistant", "content": "", "tool_calls": []})
                call = _json(content or "{}")
                out[-1]["tool_calls"].append(self._call(call.get("name"), call.get("arguments", "")))
                continue
            if role in ("tool_response", "tool"):
                given = turn.get("tool_call_id")
                call_id = given if isinstance(given, str) and given else (
                    self.pending[answered] if answered < len(self.pending)
                    else f"{self.prefix}_response_{self.count}_{answered}")
                message = {"role": "tool", "content": _arguments(content if content is not None else ""),
                           "tool_call_id": call_id}
                if isinstance(turn.get("name"), str) and turn["name"]:
                    message["name"] = turn["name"]
                out.append(message)
                answered += 1
                continue
            self.pending, answered = [], 0
            message = {"role": role, "content": content if isinstance(content, str) else
                       ("" if content is None else str(content))}
            if role == "assistant":
                if turn.get("reasoning_content"):
                    message["reasoning_content"] = str(turn["reasoning_content"])
                if turn.get("tool_calls") is not None:
                    message["tool_calls"] = [self._call(call["function"].get("name"),
                                                        call["function"].get("arguments", ""), call.get("id"))
                                             for call in turn["tool_calls"]]
            out.append(message)
        return out


#: xLAM's parameter types -> JSON schema's.
_XLAM_TYPES: dict[str, str] = {"str": "string", "string": "string", "int": "integer", "integer": "integer",
                               "float": "number", "double": "number", "number": "number", "bool": "boolean",
                               "boolean": "boolean", "list": "array", "array": "array", "object": "object"}


def _xlam_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, spec in (tool.get("parameters") or {}).items():
        if spec is None:
            continue
        prop = {"type": _XLAM_TYPES.get(str(spec.get("type", "string")).lower(), "string"),
                "description": spec.get("description", "")}
        if "enum" in spec:
            prop["enum"] = spec["enum"]
        if "default" in spec:
            prop["default"] = spec["default"]
        else:
            required.append(name)
        properties[name] = prop
    parameters: dict[str, Any] = {"type": "object", "properties": properties, **({"required": required} if required
                                                                                   else {})}
    return {"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                             "parameters": parameters}}


def _xlam(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    tools = [_xlam_tool(tool) for tool in _json(data["tools"]) or [] if tool.get("name")]
    prefix = f"call_{data['id']}" if data.get("id") is not None else "call"
    calls = [{"id": f"{prefix}_{i}", "type": "function",
              "function": {"name": call["name"], "arguments": _arguments(call.get("arguments", ""))}}
             for i, call in enumerate(_json(data["answers"]) or []) if call.get("name")]
    return {MESSAGES: [{"role": "user", "content": _text(data["query"], "query")},
                       {"role": "assistant", "content": "", "tool_calls": calls}], TOOLS: tools}
