"""Model directories and shapes that cannot be trained are one line before anything is allocated: a config.json with
text for a number, weights that do not fit their config, quantised integer weights, a shape whose parameters alone
exceed the machine, a million layers, a negative position limit."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_causal_lm

from remat.errors import ConfigError
from remat.models import ModelConfig, build_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "ok"
    tiny_causal_lm(hidden_size=32, intermediate_size=64, vocab_size=100).save_pretrained(directory)
    return directory


def _variant(saved: Path, tmp_path: Path, **config: object) -> Path:
    directory = tmp_path / "variant"
    shutil.copytree(saved, directory)
    data = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**data, **config}))
    return directory


def _refusal(**source: object) -> str:
    with pytest.raises(ConfigError) as info:
        build_model(ModelConfig(**source))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_config_json_with_text_for_a_number_is_one_line(saved: Path, tmp_path: Path) -> None:
    message = _refusal(pretrained_model_name_or_path=str(_variant(saved, tmp_path, hidden_size="32")))
    assert message.startswith("model.pretrained_model_name_or_path: cannot read a transformers config from")
    assert "hidden_size" in message


def test_weights_that_do_not_fit_their_config_are_one_line(saved: Path, tmp_path: Path) -> None:
    message = _refusal(pretrained_model_name_or_path=str(_variant(saved, tmp_path, intermediate_size=48)))
    assert "cannot load a causal LM (its weights do not fit its config.json)" in message


def test_integer_weights_are_refused_not_cast(saved: Path, tmp_path: Path) -> None:
    directory = tmp_path / "int8"
    shutil.copytree(saved, directory)
    weights = load_file(directory / "model.safetensors")
    weights["lm_head.weight"] = (weights["lm_head.weight"] * 100).to(torch.int8)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    message = _refusal(pretrained_model_name_or_path=str(directory))
    assert "model.safetensors holds I8 weights (lm_head.weight); remat trains floating-point weights" in message


@pytest.mark.parametrize(("config", "message"), [
    ({"num_hidden_layers": 1_000_000}, "model: num_hidden_layers 1000000; allowed: at most 4096"),
    ({"hidden_size": 65536, "intermediate_size": 262144, "num_hidden_layers": 200, "num_attention_heads": 64},
     "model: the parameters alone need at least 25.0 TiB (num_hidden_layers 200, hidden_size 65536"),
    ({"max_position_embeddings": -1}, "model.config.max_position_embeddings: got -1; allowed: an integer >= 1"),
])
def test_shapes_that_cannot_be_built_answer_before_allocating(config: dict[str, int], message: str) -> None:
    start = time.perf_counter()
    assert message in _refusal(preset="tiny-llama", config=config)
    assert time.perf_counter() - start < 10


class _RunsCode:
    """A pickled object whose loading would run code (writes a marker): what weights-only loading refuses."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))  # unpickling would create the marker file


def test_a_pickled_weights_file_that_names_more_than_tensors_is_one_line_and_runs_nothing(saved: Path,
                                                                                          tmp_path: Path) -> None:
    directory = tmp_path / "pickled"
    shutil.copytree(saved, directory)
    weights = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    torch.save({**weights, "extra": _RunsCode(marker)}, directory / "pytorch_model.bin")
    message = _refusal(pretrained_model_name_or_path=str(directory))
    assert message.startswith(f"model.pretrained_model_name_or_path: {str(directory)!r} holds a pickled weights file "
                              "(pytorch_model.bin) that names more than tensors")
    assert not marker.exists()


def test_a_lora_rank_above_every_layer_s_is_one_line_not_an_allocation_error() -> None:
    from remat.recipes.build import apply_lora
    from remat.recipes.config import PeftConfig

    with pytest.raises(ConfigError, match=r"^peft.r: got 1000000000, more than the rank of any linear layer of "
                                          r"LlamaForCausalLM \(at most 32: min\(in, out\) features\); allowed: 1 to 32"):
        apply_lora(tiny_causal_lm(hidden_size=32, intermediate_size=64, vocab_size=100), PeftConfig(r=10**9))
