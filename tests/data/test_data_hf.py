"""Datasets written with `datasets.save_to_disk` (a Dataset or a DatasetDict with splits)."""

from __future__ import annotations

import datasets
import pytest

from remat.data import DatasetConfig, build_dataset
from remat.errors import ConfigError


@pytest.fixture
def dataset_dict_dir(tmp_path):
    path = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"prompt": ["a", "b"], "completion": ["c", "d"]}),
            "test": datasets.Dataset.from_dict({"prompt": ["e"], "completion": ["f g"]}),
        }
    ).save_to_disk(str(path))
    return path


def test_single_dataset(word_tok, wid, tmp_path) -> None:
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["a b", "c"]}).save_to_disk(str(path))
    ds = build_dataset(DatasetConfig(path=str(path), seq_length=4, packing=False), word_tok)
    assert ds.format == "text"
    assert ds.tensors["input_ids"].tolist() == [[0] + wid("a b") + [1], [0] + wid("c") + [1, 2]]


def test_dataset_dict_uses_split_or_the_default(word_tok, wid, dataset_dict_dir) -> None:
    train = build_dataset(DatasetConfig(path=str(dataset_dict_dir), seq_length=4, packing=False), word_tok)
    test = build_dataset(
        DatasetConfig(path=str(dataset_dict_dir), seq_length=4, packing=False), word_tok, default_split="test"
    )
    explicit = build_dataset(
        DatasetConfig(path=str(dataset_dict_dir), split="test", seq_length=4, packing=False), word_tok
    )
    assert train.format == "prompt_completion"
    assert train.tensors["input_ids"][:, 1].tolist() == wid("a b")
    assert test.tensors["labels"].tolist() == [[-100, -100] + wid("f g")]
    assert explicit.tensors["labels"].tolist() == test.tensors["labels"].tolist()


def test_unknown_split_lists_the_available_ones(word_tok, dataset_dict_dir) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^validation_dataset\.split: .*dd has splits \['test', 'train'\]; got 'validation' \(the default",
    ):
        build_dataset(
            DatasetConfig(path=str(dataset_dict_dir)),
            word_tok,
            default_split="validation",
            key_prefix="validation_dataset",
        )


def test_bad_row_is_named_by_split_and_index(word_tok, dataset_dict_dir) -> None:
    with pytest.raises(ConfigError, match=r"dd\[train\] row 0 has no field 'text'"):
        build_dataset(DatasetConfig(path=str(dataset_dict_dir), format="text"), word_tok)


def test_split_on_a_single_dataset_is_refused(word_tok, tmp_path) -> None:
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(str(path))
    with pytest.raises(ConfigError, match=r"^dataset\.split: .* is a single Dataset without splits; got split 'train'"):
        build_dataset(DatasetConfig(path=str(path), split="train"), word_tok)


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/passwd", "sub/data.arrow", ".."])
def test_a_saved_dataset_naming_a_file_outside_its_directory_is_refused_unread(word_tok, tmp_path, name) -> None:
    import json

    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["a b"]}).save_to_disk(str(path))
    state = json.loads((path / "state.json").read_text())
    state["_data_files"] = [{"filename": name}]
    (path / "state.json").write_text(json.dumps(state))
    with pytest.raises(ConfigError, match=r"^dataset.path: .*state.json names .*, not a plain name inside .*; "
                                          r"allowed: the files a datasets save_to_disk wrote there \(refused unread\)"):
        build_dataset(DatasetConfig(path=str(path), seq_length=4, packing=False), word_tok)


def test_a_saved_dataset_whose_data_file_is_a_link_or_a_split_outside_is_refused(word_tok, tmp_path) -> None:
    import json

    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["a b"]}).save_to_disk(str(path))
    (data,) = path.glob("*.arrow")
    (tmp_path / "elsewhere.arrow").write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(tmp_path / "elsewhere.arrow")
    with pytest.raises(ConfigError, match=r"^dataset.path '.*arrow' is a symbolic link; allowed: a regular file"):
        build_dataset(DatasetConfig(path=str(path), seq_length=4, packing=False), word_tok)
    splits = tmp_path / "dd"
    splits.mkdir()
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["../ds"]}))
    with pytest.raises(ConfigError, match=r"dataset_dict.json names '../ds', not a plain name"):
        build_dataset(DatasetConfig(path=str(splits), seq_length=4, packing=False), word_tok)


def test_a_garbage_arrow_file_is_one_line(word_tok, tmp_path) -> None:
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["a b"]}).save_to_disk(str(path))
    (data,) = path.glob("*.arrow")
    data.write_bytes(b"not arrow at all " * 100)
    with pytest.raises(ConfigError, match=r"^dataset.path: .* is not a dataset that datasets.load_from_disk reads"):
        build_dataset(DatasetConfig(path=str(path), seq_length=4, packing=False), word_tok)
