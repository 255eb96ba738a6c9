"""``dataset.path`` as a Hugging Face Hub dataset id (``name`` its configuration, ``split`` any split or slice the
datasets library reads), loaded offline from a datasets cache built here (`hub_datasets`), and the row templates that
turn SQuAD, HellaSwag and column-mapped rows into prompts and answers (`remat.data.templates`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub_datasets import HELLASWAG_ROWS, SQUAD_ROWS, cache_hub_dataset
from pydantic import ValidationError

from remat.data.config import DatasetConfig
from remat.data.dataset import build_dataset
from remat.data.sources import iter_rows
from remat.data.templates import apply_template
from remat.errors import ConfigError


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("datasets-cache")
    cache_hub_dataset(root, "acme/squad", {"train": SQUAD_ROWS, "validation": SQUAD_ROWS[:4]}, config="plain_text")
    cache_hub_dataset(root, "acme/hellaswag", {"train": HELLASWAG_ROWS})
    return root


@pytest.fixture(autouse=True)
def offline(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The datasets library reading ``hub_cache`` with the Hub offline (its settings are read at import, so they are
    set on its modules)."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hub_cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _texts(cfg: DatasetConfig, chat: bool = False) -> list[dict]:
    rows, _ = apply_template(iter_rows(cfg), cfg, chat=chat)
    return [row.data for row in rows]


def test_a_hub_id_reads_the_split_and_configuration_from_the_cache(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="remat.data")
    rows = list(iter_rows(DatasetConfig(path="acme/squad", name="plain_text", split="validation")))
    assert [row.data["id"] for row in rows] == ["0", "1", "2", "3"]
    assert rows[1].where == "acme/squad/plain_text[validation] row 1"
    assert "dataset.path: the Hub dataset acme/squad/plain_text[validation], 4 rows (from the HF cache, offline)" in (
        caplog.text)
    assert "Using the latest cached version" not in caplog.text  # the datasets library's own two lines are not said
    sliced = list(iter_rows(DatasetConfig(path="acme/squad", split="train[:3]")))
    assert [row.data["id"] for row in sliced] == ["0", "1", "2"]


def test_squad_rows_become_nemo_s_prompt_and_answer() -> None:
    cfg = DatasetConfig(path="acme/squad", template="squad", max_samples=1)
    assert _texts(cfg) == [{"prompt": "Context: the city number 0 lies by the river Question: where does city 0 lie "
                                      "Answer:", "completion": " by the river"}]
    assert _texts(cfg, chat=True) == [{"messages": [
        {"role": "user", "content": "Context: the city number 0 lies by the river Question: where does city 0 lie "
                                    "Answer: "},
        {"role": "assistant", "content": "by the river"}]}]


def test_hellaswag_rows_are_the_context_and_the_labelled_ending() -> None:
    cfg = DatasetConfig(path="acme/hellaswag", template="hellaswag", max_samples=3)
    assert _texts(cfg, chat=True) == [  # never a chat, as in NeMo
        {"prompt": "a man walks 0 steps and", "completion": " sits down."},
        {"prompt": "a man walks 1 steps and", "completion": " runs away."},
        {"prompt": "a man walks 2 steps and", "completion": " jumps."}]


def test_mapped_columns_are_context_question_and_answer() -> None:
    cfg = DatasetConfig(path="acme/squad", template="columns", max_samples=1,
                        column_mapping={"context": "context", "question": "question", "answer": "title"})
    assert _texts(cfg) == [{"prompt": "the city number 0 lies by the river where does city 0 lie", "completion": " t"}]
    assert _texts(cfg, chat=True)[0]["messages"] == [
        {"role": "system", "content": "the city number 0 lies by the river"},
        {"role": "user", "content": "where does city 0 lie"}, {"role": "assistant", "content": "t"}]


def test_only_the_answer_is_a_target_in_the_built_rows(builtin_tok) -> None:
    for chat in (False, True):
        cfg = DatasetConfig(path="acme/squad", template="squad", seq_length=64, packing=False, max_samples=2,
                            use_chat_template=chat)
        dataset = build_dataset(cfg, builtin_tok)
        row = dataset[0]
        targets = builtin_tok.decode(row["input_ids"][row["labels"] != -100])
        assert targets == ("by the river" if chat else " by the river") + builtin_tok.eos_token, (chat, targets)


@pytest.mark.parametrize(("cfg", "message"), [
    (dict(path="acme/missing"), r"^dataset.path: cannot load the dataset for the Hub id 'acme/missing' \(HF_HUB_OFFLINE "
                                r"is set and 'acme/missing' is not in the Hugging Face datasets cache \(.*\): download "
                                r"it while online \(`python -c \"import datasets; datasets.load_dataset\('acme/missing'\)"),
    (dict(path="acme/squad", split="test"), r"^dataset.split: 'test' is not a split of the Hub dataset 'acme/squad'"),
    (dict(path="acme/hellaswag", template="squad"),
     r"^dataset.template: acme/hellaswag\[train\] row 0 does not have the 'squad' layout \(no field 'answers'; keys: "),
    (dict(path="data/trian.jsonl"), r"^dataset.path: 'data/trian.jsonl' does not exist; expected a .jsonl file, a "
                                    r"directory of them, a datasets.save_to_disk directory, or a Hugging Face Hub"),
])
def test_what_cannot_be_read_is_one_line(cfg: dict, message: str, builtin_tok) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build_dataset(DatasetConfig(**cfg), builtin_tok)
    assert "\n" not in str(info.value)


def test_a_local_path_takes_no_hub_configuration(write_jsonl, builtin_tok) -> None:
    path = write_jsonl([{"text": "a b c"}])
    with pytest.raises(ConfigError, match=r"^dataset.name: 'plain_text' is a Hub dataset's configuration; .* is on the "
                                          r"local disk"):
        build_dataset(DatasetConfig(path=str(path), name="plain_text"), builtin_tok)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(path="acme/x", template="columns"), "template: 'columns' and column_mapping go together"),
    (dict(path="acme/x", template="columns", column_mapping={"answer": "a"}), "allowed: 'answer' and 'context'"),
    (dict(path="acme/x", template="columns", column_mapping={"answer": "a", "topic": "t"}), "role 'topic' is not"),
    (dict(template="squad"), "template: 'squad' needs a dataset path"),
    (dict(path="acme/x", template="squad", format="text"), "a template makes prompts and answers"),
])
def test_template_settings_that_do_not_fit_are_refused_at_load(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        DatasetConfig(**fields)
