"""Cutting encoded documents into fixed-length training rows: packed, or one padded example per document.

Packed rows: documents are concatenated and cut every `seq_length` tokens (the incomplete tail is dropped).
`position_ids` restart at 0 where a document starts and at the start of every row (a document cut by a row boundary
continues as a new segment). HF models build a block-diagonal causal mask from such `position_ids` when no
`attention_mask` is given, so documents do not attend to each other. `labels` are the input ids with non-target
tokens set to -100; the loss is HF-style (logits at t predict labels[t+1]), so the first token of a document that
starts inside a row is also -100: no document is predicted from the one before it.

Padded rows: each document is truncated to `seq_length`, then padded; padding has label -100 and attention mask 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from remat.data.formats import EncodedDocument

IGNORE_INDEX = -100


@dataclass
class Rows:
    """Training rows as `[num_rows, seq_length]` LongTensors, plus what was cut away to make them."""

    tensors: dict[str, torch.Tensor]
    dropped_tail_tokens: int = 0
    truncated_documents: int = 0


def _concatenate(arrays: Sequence[np.ndarray], dtype: type, total: int) -> np.ndarray:
    """The first `total` elements of `arrays` end to end, written into one array of `dtype` (no intermediate)."""
    out = np.empty(total, dtype=dtype)
    at = 0
    for array in arrays:
        take = min(len(array), total - at)
        out[at : at + take] = array[:take]
        at += take
        if at == total:
            break
    return out


def pack_documents(documents: Sequence[EncodedDocument], seq_length: int) -> Rows:
    """Concatenate `documents` and cut them into rows of exactly `seq_length` tokens (see the module docstring).

    Works in numpy on the kept tokens with one int64 array per output and one scratch array (about 32 bytes a token
    at the peak, besides the documents), then hands the arrays to torch without copying."""
    lengths = np.fromiter((len(d.input_ids) for d in documents), np.int64, len(documents))
    total = int(lengths.sum())
    num_rows = total // seq_length
    kept = num_rows * seq_length
    ids = _concatenate([d.input_ids for d in documents], np.int64, kept)
    labels = ids.copy()
    labels[~_concatenate([d.loss_mask for d in documents], np.bool_, kept)] = IGNORE_INDEX
    starts = (np.cumsum(lengths) - lengths)[lengths > 0]
    starts = starts[starts < kept]
    inside = starts[starts % seq_length != 0]
    labels[inside] = IGNORE_INDEX  # a document starting inside a row is not predicted from the one before it
    # position = index - the last segment start at or before it (a document start, or a row start).
    anchor = np.zeros(kept, dtype=np.int64)
    anchor[::seq_length] = np.arange(0, kept, seq_length)
    anchor[inside] = inside
    np.maximum.accumulate(anchor, out=anchor)
    positions = np.arange(kept, dtype=np.int64)
    positions -= anchor
    del anchor
    tensors = {
        "input_ids": torch.from_numpy(ids).view(num_rows, seq_length),
        "labels": torch.from_numpy(labels).view(num_rows, seq_length),
        "position_ids": torch.from_numpy(positions).view(num_rows, seq_length),
    }
    return Rows(tensors, dropped_tail_tokens=total - kept)


def pad_documents(documents: Sequence[EncodedDocument], seq_length: int, pad_token_id: int) -> Rows:
    """One row per document: truncated to `seq_length`, right-padded with `pad_token_id`, with an attention mask."""
    count = len(documents)
    input_ids = torch.full((count, seq_length), pad_token_id, dtype=torch.long)
    labels = torch.full((count, seq_length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((count, seq_length), dtype=torch.long)
    truncated = 0
    for row, document in enumerate(documents):
        length = min(len(document.input_ids), seq_length)
        truncated += len(document.input_ids) > seq_length
        ids = torch.from_numpy(document.input_ids[:length].astype(np.int64))
        mask = torch.from_numpy(document.loss_mask[:length].copy())
        input_ids[row, :length] = ids
        labels[row, :length] = torch.where(mask, ids, torch.full_like(ids, IGNORE_INDEX))
        attention_mask[row, :length] = 1
    position_ids = torch.arange(seq_length, dtype=torch.long).expand(count, seq_length).clone()
    tensors = {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
    }
    return Rows(tensors, truncated_documents=truncated)


def rows_with_targets(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A bool per row: does it have at least one loss target (a label other than -100 after position 0)?"""
    return (tensors["labels"][:, 1:] != IGNORE_INDEX).any(dim=1)
