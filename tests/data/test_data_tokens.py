"""Rows that are token ids already (``format: tokens``) and NeMo AutoModel's mock data (``dataset.mock``): random ids
drawn exactly as NeMo's mock builder draws them for a seed, every token a target (or where ``labels`` say), no BOS or
EOS added, ids outside the tokenizer's vocabulary refused."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tiny import tiny_word_tokenizer

from remat.data.config import DatasetConfig
from remat.data.dataset import build_dataset
from remat.data.sources import iter_rows
from remat.errors import ConfigError

MOCK = {"num_sentences": 6, "mean_len": 20, "std_len": 6, "vocab_size": 100, "max_sentence_len": 24, "seed": 3}


def _nemo_s_draw(num_sentences: int, mean_len: float, std_len: float, vocab_size: int, max_sentence_len: int,
                 seed: int) -> list[list[int]]:
    """What NeMo's mock builder documents: Python's generator seeded, a Gaussian length kept within 1 and the
    maximum, uniform ids from 2 on, id 1 at the end."""
    random.seed(seed)
    words = list(range(2, vocab_size))
    rows = []
    for _ in range(num_sentences):
        length = max(1, min(max_sentence_len, int(random.gauss(mean_len, std_len))))
        rows.append(random.choices(words, k=length) + [1])
    return rows


def test_mock_rows_are_the_ids_nemo_s_builder_draws_for_the_seed() -> None:
    rows = [row.data["input_ids"] for row in iter_rows(DatasetConfig(mock=MOCK))]
    assert rows == _nemo_s_draw(**MOCK) and len({len(row) for row in rows}) > 1
    assert [row.data for row in iter_rows(DatasetConfig(mock={**MOCK, "seed": 4}))] != [{"input_ids": r} for r in rows]


def test_mock_data_trains_on_every_id_with_nothing_added() -> None:
    dataset = build_dataset(DatasetConfig(mock=MOCK, seq_length=32, packing=False), tiny_word_tokenizer())
    assert dataset.format == "tokens" and len(dataset) == 6
    first = _nemo_s_draw(**MOCK)[0]
    assert dataset[0]["input_ids"][: len(first)].tolist() == first  # no BOS in front
    labelled = dataset[0]["labels"][: len(first)].tolist()
    assert labelled == first


def test_token_rows_take_their_labels_and_ids_outside_the_vocabulary_are_refused(write_jsonl: Any) -> None:
    tokenizer = tiny_word_tokenizer()
    path = write_jsonl([{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}])
    dataset = build_dataset(DatasetConfig(path=str(path), format="tokens", seq_length=8, packing=False), tokenizer)
    assert dataset[0]["labels"][:4].tolist() == [-100, -100, 7, 8]
    bad = write_jsonl([{"input_ids": [5, len(tokenizer)]}], "bad.jsonl")
    with pytest.raises(ConfigError, match=rf"format: 'tokens' needs .* token ids from 0 to {len(tokenizer) - 1}"):
        build_dataset(DatasetConfig(path=str(bad), format="tokens", seq_length=8), tokenizer)
    with pytest.raises(ValueError, match="mock: random token ids are the rows; allowed with no path"):
        DatasetConfig(mock=MOCK, path=str(path))
