"""Config sections of the data pipeline: `tokenizer:` and `dataset:` (also used for `validation_dataset:`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeFloat, PositiveFloat, PositiveInt, field_validator, model_validator

from remat.config_base import StrictModel

DatasetFormat = Literal["auto", "text", "prompt_completion", "messages", "tokens"]
#: How each raw row becomes a prompt and an answer (`remat.data.templates`): the layouts of SQuAD and HellaSwag, or
#: named columns (``column_mapping``).
RowTemplate = Literal["squad", "hellaswag", "columns", "agent_chat", "xlam"]
#: The templates whose rows are conversations with tool calls (a chat template is required).
TOOL_TEMPLATES: tuple[str, ...] = ("agent_chat", "xlam")
#: The roles ``column_mapping`` may name (NeMo's column-mapped instruction data): ``answer`` and at least one other.
COLUMN_ROLES: tuple[str, ...] = ("context", "question", "answer")

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


class AgentChatOptions(StrictModel):
    """``dataset.agent_chat``: how the ``agent_chat`` template shapes a trace (NeMo's ``make_agent_chat_dataset``)."""

    trim_incomplete_last_turn: bool = False
    """Drop the messages after the last assistant turn (an unfinished exchange)."""
    drop_history_reasoning_content: bool = False
    """Keep ``reasoning_content`` on the last assistant turn only, as a model never sees its earlier thinking."""
    truncate_history: bool = False
    """A trace whose document is longer than ``seq_length`` loses its oldest exchanges (cut at user turns; the leading
    system turns, the tools and the last exchange kept) until it fits, instead of being cut at its end."""
    filter_overlong: bool = False
    """A trace whose document is still longer than ``seq_length`` is dropped (counted in a line), not cut."""


class MockConfig(StrictModel):
    """``dataset.mock``: rows of random token ids, for measuring a step without data (NeMo AutoModel's mock builder:
    ids 2 to ``vocab_size`` - 1 drawn uniformly, a length drawn from a normal distribution and kept within 1 to
    ``max_sentence_len``, then id 1 as the end; Python's generator seeded with ``seed``)."""

    num_sentences: PositiveInt = 10
    mean_len: PositiveFloat = 20.0
    std_len: NonNegativeFloat = 6.0
    vocab_size: int = Field(default=100, ge=3)
    max_sentence_len: PositiveInt = 64
    seed: int = 0


class DatasetConfig(StrictModel):
    """Which rows to read, how to interpret them, and how to cut them into training examples.

    `path`: None for the builtin corpus; a `.jsonl` file, a list of them, a directory of `.jsonl` files, a
    directory written by `datasets.Dataset(Dict).save_to_disk`, or a Hugging Face Hub dataset id (``org/name``, with
    ``name`` its configuration; loaded by `datasets.load_dataset`, from the HF cache when offline). Existence is
    checked when the dataset is built. `template` turns each raw row into a prompt and an answer (SQuAD's and
    HellaSwag's layouts, or `column_mapping`'s columns), as a chat when the tokenizer has a chat template and
    `use_chat_template` is not false, or into a conversation with tool calls (``agent_chat``, ``xlam``)
    (`remat.data.templates`).
    """

    path: str | list[str] | None = None
    name: str | None = None
    revision: str | None = None
    """A Hub dataset's revision (a branch, tag or commit; e.g. ``refs/convert/parquet``)."""
    format: DatasetFormat = "auto"
    template: RowTemplate | None = None
    column_mapping: dict[str, str] | None = None
    agent_chat: AgentChatOptions | None = None
    mock: MockConfig | None = None
    """Random token ids instead of data (`MockConfig`); the rows are in the ``tokens`` format."""
    use_chat_template: bool | None = None
    chat_template: str | None = None
    """A file holding a Jinja chat template that renders this dataset's conversations in place of the tokenizer's
    (NeMo's builders take one as ``chat_template``). A template is data: transformers renders it in its sandbox."""
    split: str | None = None
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    messages_field: str = "messages"
    tools_field: str = "tools"
    """The field of a ``messages`` row holding its tool definitions (OpenAI function schemas, or that list as JSON
    text), rendered with its conversation by the chat template; a row without it has none."""
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

    @field_validator("column_mapping")
    @classmethod
    def _known_roles(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        unknown = sorted(set(value) - set(COLUMN_ROLES))
        if unknown:
            raise ValueError(f"role {unknown[0]!r} is not one remat maps; allowed roles: {', '.join(COLUMN_ROLES)}")
        if "answer" not in value or len(value) < 2:
            raise ValueError(f"got roles {sorted(value)}; allowed: 'answer' and 'context' and/or 'question'")
        return value

    @model_validator(mode="after")
    def _template_fits(self) -> DatasetConfig:
        if self.template is not None and self.format not in ("auto", "prompt_completion", "messages"):
            raise ValueError(f"format: {self.format!r} with template {self.template!r}; a template makes prompts and "
                             "answers: allowed format: auto")
        if (self.template == "columns") != (self.column_mapping is not None):
            raise ValueError("template: 'columns' and column_mapping go together; allowed: template: columns with "
                             "column_mapping: {context: COL, question: COL, answer: COL}, or neither")
        if self.mock is not None and (self.path is not None or self.template is not None
                                      or self.format not in ("auto", "tokens")):
            raise ValueError("mock: random token ids are the rows; allowed with no path, no template and format "
                             "auto or tokens")
        if self.agent_chat is not None and self.template != "agent_chat":
            raise ValueError(f"agent_chat: options of the agent_chat template, but template is {self.template!r}; "
                             "allowed: template: agent_chat, or no agent_chat section")
        if self.template is not None and self.path is None:
            raise ValueError(f"template: {self.template!r} needs a dataset path (a Hub id or files with those columns); "
                             "the builtin corpus is plain text")
        if self.revision is not None and not isinstance(self.path, str):
            raise ValueError("revision: a Hub dataset's revision needs one path (the Hub id); allowed: path: ORG/NAME")
        if self.name is not None and not isinstance(self.path, str):
            raise ValueError("name: a Hub dataset's configuration needs one path (the Hub id); allowed: path: ORG/NAME")
        return self

    @field_validator("split", "name", "revision", "text_field", "prompt_field", "completion_field", "messages_field",
                     "tools_field")
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
