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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from remat.data.formats import EncodedDocument

IGNORE_INDEX = -100


@dataclass
class Rows:
    """Training rows as `[num_rows, seq_length]` LongTensors, plus what was cut away to make them."""

    tensors: dict[str, torch.Tensor]
    dropped_tail_tokens: int = 0
    truncated_documents: int = 0


def _flatten(documents: Sequence[EncodedDocument]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.tensor(list(itertools.chain.from_iterable(d.input_ids for d in documents)), dtype=torch.long)
    mask = torch.tensor(list(itertools.chain.from_iterable(d.loss_mask for d in documents)), dtype=torch.bool)
    lengths = torch.tensor([len(d.input_ids) for d in documents], dtype=torch.long)
    starts = (torch.cumsum(lengths, 0) - lengths)[lengths > 0]
    doc_start = torch.zeros(ids.numel(), dtype=torch.bool)
    doc_start[starts] = True
    return ids, mask, doc_start


def pack_documents(documents: Sequence[EncodedDocument], seq_length: int) -> Rows:
    """Concatenate `documents` and cut them into rows of exactly `seq_length` tokens (see the module docstring)."""
    ids, mask, doc_start = _flatten(documents)
    total = ids.numel()
    num_rows = total // seq_length
    kept = num_rows * seq_length
    ids, mask, doc_start = ids[:kept], mask[:kept], doc_start[:kept]
    index = torch.arange(kept)
    row_start = index % seq_length == 0
    segment_anchor = torch.where(doc_start | row_start, index, torch.zeros_like(index)).cummax(0).values
    labels = torch.where(mask, ids, torch.full_like(ids, IGNORE_INDEX))
    labels[doc_start & ~row_start] = IGNORE_INDEX
    tensors = {
        "input_ids": ids.view(num_rows, seq_length),
        "labels": labels.view(num_rows, seq_length),
        "position_ids": (index - segment_anchor).view(num_rows, seq_length),
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
        ids = torch.tensor(document.input_ids[:length], dtype=torch.long)
        mask = torch.tensor(document.loss_mask[:length], dtype=torch.bool)
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
