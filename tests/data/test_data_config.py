"""Validation of the `tokenizer:` and `dataset:` config sections."""

from __future__ import annotations

import pydantic
import pytest

from remat.data import DatasetConfig, TokenizerConfig


def test_defaults() -> None:
    cfg = DatasetConfig()
    assert (cfg.path, cfg.format, cfg.seq_length, cfg.packing, cfg.shuffle, cfg.max_samples) == (
        None,
        "auto",
        256,
        True,
        True,
        None,
    )
    assert cfg.paths is None
    assert DatasetConfig(path="a.jsonl").paths == ["a.jsonl"]
    assert DatasetConfig(path=["a.jsonl", "b.jsonl"]).paths == ["a.jsonl", "b.jsonl"]
    assert TokenizerConfig().vocab_size == 4096


@pytest.mark.parametrize(
    ("kwargs", "loc", "message"),
    [
        ({"seq_length": 1}, "seq_length", "greater than or equal to 2"),
        ({"max_samples": 0}, "max_samples", "greater than or equal to 1"),
        ({"format": "chat"}, "format", "'auto', 'text', 'prompt_completion', 'messages' or 'tokens'"),
        ({"path": ""}, "path", "must be a path, a list of paths, or null for the builtin corpus; got ''"),
        ({"path": []}, "path", "must list at least one .jsonl file"),
        ({"path": ["a.jsonl", " "]}, "path", "entry 1 is an empty string"),
        ({"text_field": ""}, "text_field", "must be a non-empty name"),
        ({"split": ""}, "split", "must be a non-empty name"),
        ({"seq_len": 128}, "seq_len", "Extra inputs are not permitted"),
    ],
)
def test_dataset_config_errors_name_the_key(kwargs, loc, message) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        DatasetConfig(**kwargs)
    (error,) = info.value.errors()
    assert error["loc"][0] == loc
    assert message in error["msg"]


@pytest.mark.parametrize(("vocab_size", "ok"), [(511, False), (512, True), (65536, True), (65537, False)])
def test_tokenizer_vocab_size_range(vocab_size, ok) -> None:
    if ok:
        assert TokenizerConfig(vocab_size=vocab_size).vocab_size == vocab_size
        return
    with pytest.raises(pydantic.ValidationError, match=rf"must be between 512 and 65536 .*got {vocab_size}"):
        TokenizerConfig(vocab_size=vocab_size)


def test_assignment_is_validated_too() -> None:
    cfg = DatasetConfig()
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 2"):
        cfg.seq_length = 0
