"""Fixtures of the data-pipeline tests: an isolated tokenizer cache, a word-level tokenizer with known ids, JSONL."""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from remat.data.tokenizer import builtin_tokenizer

# Word-level ids: <bos>=0, <eos>=1, <pad>=2, <unk>=3, then "a"=4, "b"=5, ... "z"=29.
WORD_VOCAB = {"<bos>": 0, "<eos>": 1, "<pad>": 2, "<unk>": 3} | {c: 4 + i for i, c in enumerate(string.ascii_lowercase)}


@pytest.fixture(scope="session")
def wid() -> Callable[[str], list[int]]:
    """Ids of the space-separated words of a string in the word-level test tokenizer."""
    return lambda words: [WORD_VOCAB[word] for word in words.split()]


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "remat-cache"
    monkeypatch.setenv("REMAT_CACHE_DIR", str(cache))
    return cache


@pytest.fixture(scope="session")
def builtin_tok(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PreTrainedTokenizerBase]:
    """The builtin tokenizer, trained once per session into its own cache directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REMAT_CACHE_DIR", str(tmp_path_factory.mktemp("builtin-cache")))
        yield builtin_tokenizer(4096)


@pytest.fixture(scope="session")
def word_tok() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over single letters, so expected ids can be written by hand."""
    tokenizer = Tokenizer(models.WordLevel(WORD_VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """Write rows (dicts, or raw strings written verbatim as lines) to tmp_path/<name>."""

    def write(rows: list[Any], name: str = "data.jsonl") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    return write
