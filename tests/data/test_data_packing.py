"""Packing and padding of encoded documents: exact tensors for hand-made documents."""

from __future__ import annotations

import torch

from remat.data.formats import EncodedDocument
from remat.data.packing import IGNORE_INDEX, pack_documents, pad_documents, rows_with_targets

X = IGNORE_INDEX


def doc(ids: list[int], mask: list[int]) -> EncodedDocument:
    return EncodedDocument(ids, [bool(m) for m in mask])


def test_pack_restarts_positions_and_masks_document_starts_inside_rows() -> None:
    documents = [
        doc([0, 10, 11, 1], [0, 1, 1, 1]),  # BOS never a target
        doc([0, 20, 21, 22, 23, 1], [0, 0, 0, 1, 1, 1]),  # a prompt of two tokens, crosses the row boundary
        doc([0, 30, 1], [0, 1, 1]),
        doc([0, 40, 41, 1], [0, 1, 1, 1]),  # the last 3 tokens do not fill a row
    ]
    rows = pack_documents(documents, seq_length=5)
    assert rows.dropped_tail_tokens == 2
    assert rows.tensors["input_ids"].tolist() == [
        [0, 10, 11, 1, 0],
        [20, 21, 22, 23, 1],
        [0, 30, 1, 0, 40],
    ]
    assert rows.tensors["position_ids"].tolist() == [
        [0, 1, 2, 3, 0],
        [0, 1, 2, 3, 4],  # a document cut by the row boundary continues as a new segment at 0
        [0, 1, 2, 0, 1],
    ]
    assert rows.tensors["labels"].tolist() == [
        [X, 10, 11, 1, X],
        [X, X, 22, 23, 1],
        [X, 30, 1, X, 40],
    ]
    assert all(t.dtype == torch.long for t in rows.tensors.values())


def test_pack_masks_first_token_of_inner_document_even_when_it_is_a_target() -> None:
    # Without BOS, a document's first token is a target of its own; inside a row it must not be predicted from the
    # previous document, at position 0 of a row it is never predicted anyway.
    documents = [doc([5, 6], [1, 1]), doc([7, 8], [1, 1]), doc([9, 4], [1, 1])]
    rows = pack_documents(documents, seq_length=3)
    assert rows.tensors["input_ids"].tolist() == [[5, 6, 7], [8, 9, 4]]
    assert rows.tensors["labels"].tolist() == [[5, 6, X], [8, X, 4]]
    assert rows.tensors["position_ids"].tolist() == [[0, 1, 0], [0, 0, 1]]
    assert rows.dropped_tail_tokens == 0


def test_pack_of_too_few_tokens_gives_no_rows() -> None:
    rows = pack_documents([doc([1, 2, 3], [1, 1, 1])], seq_length=4)
    assert rows.tensors["input_ids"].shape == (0, 4)
    assert rows.dropped_tail_tokens == 3


def test_pad_truncates_pads_and_masks_padding() -> None:
    documents = [doc([0, 10, 11, 1], [0, 0, 1, 1]), doc([0, 20, 21, 22, 23, 24, 1], [0, 1, 1, 1, 1, 1, 1])]
    rows = pad_documents(documents, seq_length=5, pad_token_id=2)
    assert rows.truncated_documents == 1
    assert rows.tensors["input_ids"].tolist() == [[0, 10, 11, 1, 2], [0, 20, 21, 22, 23]]
    assert rows.tensors["labels"].tolist() == [[X, X, 11, 1, X], [X, 20, 21, 22, 23]]
    assert rows.tensors["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert rows.tensors["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2


def test_rows_with_targets_ignores_position_zero() -> None:
    labels = torch.tensor([[7, X, X], [X, X, 3], [X, X, X]])
    assert rows_with_targets({"labels": labels}).tolist() == [False, True, False]
