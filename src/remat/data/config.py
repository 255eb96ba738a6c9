"""Config sections of the data pipeline: `tokenizer:` and `dataset:` (also used for `validation_dataset:`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from remat.config_base import StrictModel

DatasetFormat = Literal["auto", "text", "prompt_completion", "messages"]

MIN_BUILTIN_VOCAB = 512
MAX_BUILTIN_VOCAB = 65536


class TokenizerConfig(StrictModel):
    """Where the tokenizer comes from.

    `path` is a local directory with tokenizer files or a `tokenizer.json` file. When it is None, the model's local
    pretrained directory is used if it holds tokenizer files, else the builtin byte-level BPE trained on the builtin
    corpus with `vocab_size` entries (an upper bound: the small corpus supports about 9k).
    """

    path: str | None = None
    vocab_size: int = 4096

    @field_validator("path")
    @classmethod
    def _path_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be a local directory or tokenizer.json file, or null for the default; got ''")
        return value

    @field_validator("vocab_size")
    @classmethod
    def _vocab_in_range(cls, value: int) -> int:
        if not MIN_BUILTIN_VOCAB <= value <= MAX_BUILTIN_VOCAB:
            raise ValueError(
                f"must be between {MIN_BUILTIN_VOCAB} and {MAX_BUILTIN_VOCAB} (builtin byte-level BPE); got {value}"
            )
        return value


class DatasetConfig(StrictModel):
    """Which rows to read, how to interpret them, and how to cut them into training examples.

    `path`: None for the builtin corpus; a `.jsonl` file, a list of them, a directory of `.jsonl` files, or a
    directory written by `datasets.Dataset(Dict).save_to_disk`. Existence is checked when the dataset is built.
    """

    path: str | list[str] | None = None
    format: DatasetFormat = "auto"
    split: str | None = None
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    seq_length: int = Field(default=256, ge=2)
    packing: bool = True
    shuffle: bool = True
    max_samples: int | None = Field(default=None, ge=1)

    @field_validator("path")
    @classmethod
    def _paths_not_blank(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list):
            if not value:
                raise ValueError("must list at least one .jsonl file, or be null for the builtin corpus; got []")
            blank = [i for i, item in enumerate(value) if not item.strip()]
            if blank:
                raise ValueError(f"entry {blank[0]} is an empty string; every entry must be a path")
        elif value is not None and not value.strip():
            raise ValueError("must be a path, a list of paths, or null for the builtin corpus; got ''")
        return value

    @field_validator("split", "text_field", "prompt_field", "completion_field", "messages_field")
    @classmethod
    def _name_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must be a non-empty name; got ''")
        return value

    @property
    def paths(self) -> list[str] | None:
        """`path` as a list (None for the builtin corpus)."""
        if self.path is None:
            return None
        return [self.path] if isinstance(self.path, str) else list(self.path)
