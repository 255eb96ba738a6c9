"""`build_dataset`: from a `dataset:` config section and a tokenizer to fixed-length training rows in memory."""

from __future__ import annotations

import copy
import itertools
import logging

import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from remat._files import read_regular_bytes
from remat.data.config import DatasetConfig
from remat.data.formats import detect_format, encode_rows
from remat.data.packing import IGNORE_INDEX, Rows, pack_documents, pad_documents, rows_with_targets
from remat.data.sources import iter_rows, no_rows_message
from remat.data.templates import COMPLETION, MESSAGES, PROMPT, TOOLS, apply_template
from remat.errors import ConfigError

logger = logging.getLogger(__name__)


class TokenizedDataset(Dataset[dict[str, torch.Tensor]]):
    """Training rows held as `[num_rows, seq_length]` LongTensors; item i is a dict of `[seq_length]` views."""

    def __init__(self, tensors: dict[str, torch.Tensor], *, format: str, packed: bool) -> None:
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        if "input_ids" not in tensors or len(set(shapes.values())) != 1 or len(shapes["input_ids"]) != 2:
            raise ValueError(f"expected equal [rows, seq_length] tensors including input_ids; got {shapes}")
        self.tensors = tensors
        self.format = format
        self.packed = packed

    def __len__(self) -> int:
        return self.tensors["input_ids"].shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: tensor[index] for name, tensor in self.tensors.items()}

    @property
    def seq_length(self) -> int:
        """Tokens per row."""
        return self.tensors["input_ids"].shape[1]

    @property
    def num_label_tokens(self) -> int:
        """Loss targets in the dataset: labels other than -100 after position 0 (label 0 is never predicted)."""
        return int((self.tensors["labels"][:, 1:] != IGNORE_INDEX).sum())

    def __repr__(self) -> str:
        return (
            f"TokenizedDataset(rows={len(self)}, seq_length={self.seq_length}, format={self.format!r}, "
            f"packed={self.packed}, label_tokens={self.num_label_tokens})"
        )


def _pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def _cut(documents: list, cfg: DatasetConfig, tokenizer: PreTrainedTokenizerBase, key_prefix: str) -> Rows:
    if cfg.packing:
        rows = pack_documents(documents, cfg.seq_length)
        total = sum(len(d.input_ids) for d in documents)
        if not rows.tensors["input_ids"].shape[0]:
            raise ConfigError(
                f"{key_prefix}.seq_length: the data holds {total} tokens, fewer than one packed row of "
                f"{cfg.seq_length}; lower {key_prefix}.seq_length or add data"
            )
        logger.debug("packing dropped the last %d of %d tokens (an incomplete row)", rows.dropped_tail_tokens, total)
        return rows
    rows = pad_documents(documents, cfg.seq_length, _pad_token_id(tokenizer))
    if rows.truncated_documents:
        logger.info(
            "%d of %d examples were longer than %s.seq_length=%d and were truncated",
            rows.truncated_documents,
            len(documents),
            key_prefix,
            cfg.seq_length,
        )
    return rows


def _chat(cfg: DatasetConfig, tokenizer: PreTrainedTokenizerBase, key_prefix: str) -> bool:
    """Whether a template's rows are conversations: ``use_chat_template``, or (unset) whether the tokenizer has a chat
    template, as NeMo AutoModel's builders decide."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if cfg.use_chat_template and not has_template:
        raise ConfigError(f"{key_prefix}.use_chat_template: true, and the tokenizer has no chat template; allowed: "
                          "false or unset (prompt and answer as text)")
    return has_template if cfg.use_chat_template is None else cfg.use_chat_template


CHAT_TEMPLATE_LIMIT = 1 << 20
"""The largest chat template file read (the published ones are a few KiB)."""


def with_chat_template(tokenizer: PreTrainedTokenizerBase, path: str, *, key: str) -> PreTrainedTokenizerBase:
    """A shallow copy of ``tokenizer`` whose chat template is the one in the file ``path`` (the recipe's tokenizer,
    which checkpoints save, keeps its own); `ConfigError` naming ``key`` for a file that is missing, not a regular
    file, too large, not UTF-8 or empty."""
    try:
        text = read_regular_bytes(path, key, limit=CHAT_TEMPLATE_LIMIT).decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{key}: {path!r} is not UTF-8 text ({err}); allowed: a file holding a Jinja chat "
                          "template") from None
    if not text.strip():
        raise ConfigError(f"{key}: {path!r} is empty; allowed: a file holding a Jinja chat template")
    copied = copy.copy(tokenizer)
    copied.chat_template = text
    return copied


def build_dataset(
    cfg: DatasetConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    default_split: str = "train",
    key_prefix: str = "dataset",
) -> TokenizedDataset:
    """Read, tokenize, mask and cut the rows `cfg` names; `key_prefix` names the config section in errors.

    `default_split` applies when `cfg.split` is None (the builtin corpus, HF DatasetDict directories). Rows without a
    single loss target are dropped (and counted in a log line).
    """
    if cfg.mock is not None:
        cfg = cfg.model_copy(update={"format": "tokens"})
    elif cfg.path is None and cfg.format not in ("auto", "text"):
        raise ConfigError(
            f"{key_prefix}.format: the builtin corpus (no {key_prefix}.path) is plain text; got {cfg.format!r}, "
            "allowed 'auto' or 'text'"
        )
    if cfg.chat_template is not None:
        tokenizer = with_chat_template(tokenizer, cfg.chat_template, key=f"{key_prefix}.chat_template")
    raw_rows = iter_rows(cfg, default_split=default_split, key_prefix=key_prefix)
    if cfg.template is not None:
        raw_rows, templated = apply_template(raw_rows, cfg, chat=_chat(cfg, tokenizer, key_prefix),
                                             key_prefix=key_prefix)
        cfg = cfg.model_copy(update={"format": templated, "prompt_field": PROMPT, "completion_field": COMPLETION,
                                     "messages_field": MESSAGES, "tools_field": TOOLS})
    first = next(raw_rows, None)
    if first is None:
        raise ConfigError(no_rows_message(cfg, key_prefix))
    fmt = detect_format(cfg, first, key_prefix=key_prefix)
    # Rows stream into the encoder, which holds one group of them at a time: no reference to the first stays here.
    rows_in = itertools.chain((first,), raw_rows)
    del first
    documents = encode_rows(rows_in, fmt, cfg, tokenizer, key_prefix=key_prefix)
    rows = _cut(documents, cfg, tokenizer, key_prefix)
    has_targets = rows_with_targets(rows.tensors)
    if not bool(has_targets.any()):
        raise ConfigError(f"{key_prefix}: no row has a loss target (every label is masked) in {cfg.path!r}")
    tensors = rows.tensors
    if not bool(has_targets.all()):
        logger.info("dropped %d of %d rows without any loss target", int((~has_targets).sum()), len(has_targets))
        tensors = {name: tensor[has_targets].contiguous() for name, tensor in tensors.items()}
    dataset = TokenizedDataset(tensors, format=fmt, packed=cfg.packing)
    logger.info("%s: %d documents (%s) -> %r", key_prefix, len(documents), fmt, dataset)
    return dataset
