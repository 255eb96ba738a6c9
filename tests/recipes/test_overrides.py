"""Command-line overrides: parsing, typing and application to nested sections."""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.errors import ConfigError
from remat.recipes.loader import apply_overrides, load_recipe, parse_overrides

RECIPE = """
model:
  preset: tiny-llama
step_scheduler:
  global_batch_size: 4
  local_batch_size: 2
  max_steps: 100
"""


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    return path


def test_values_are_parsed_as_yaml() -> None:
    pairs = parse_overrides(["--a.int", "10", "--a.float=3e-4", "--a.bool", "true", "--a.str", "selective",
                             "--a.list", "[q_proj, v_proj]", "--a.map", "{mode: full, every_n_layers: 2}",
                             "--a.null", "null"])
    assert pairs == [("a.int", 10), ("a.float", 3e-4), ("a.bool", True), ("a.str", "selective"),
                     ("a.list", ["q_proj", "v_proj"]), ("a.map", {"mode": "full", "every_n_layers": 2}),
                     ("a.null", None)]


def test_overrides_create_sections_and_leave_input_untouched() -> None:
    data = {"model": {"preset": "x"}}
    out = apply_overrides(data, [("peft.r", 4), ("model.dtype", "bfloat16")])
    assert out == {"model": {"preset": "x", "dtype": "bfloat16"}, "peft": {"r": 4}}
    assert data == {"model": {"preset": "x"}}


def test_override_reaches_the_validated_config(recipe: Path) -> None:
    cfg = load_recipe(recipe, ["--step_scheduler.max_steps", "10",
                               "--distributed.activation_checkpointing", "selective"])
    assert cfg.step_scheduler.max_steps == 10
    assert cfg.distributed.activation_checkpointing.mode == "selective"  # parsed into the typed policy


def test_override_with_mapping_policy(recipe: Path) -> None:
    cfg = load_recipe(recipe, ["--distributed.activation_checkpointing={mode: full, every_n_layers: 2}"])
    assert cfg.distributed.activation_checkpointing.to_dict() == {"mode": "full", "every_n_layers": 2}


def test_unknown_override_key_is_named(recipe: Path) -> None:
    with pytest.raises(ConfigError, match=r"step_scheduler\.max_stpes: unknown key \(did you mean 'step_scheduler\.max_steps'\?\); allowed"):
        load_recipe(recipe, ["--step_scheduler.max_stpes", "10"])


@pytest.mark.parametrize(("args", "message"), [
    (["--step_scheduler.max_steps"], "missing value"),
    (["--step_scheduler.max_steps", "--seed", "1"], "missing value"),
    (["max_steps", "10"], "expected --dotted.key VALUE"),
    (["--a..b", "1"], "malformed key"),
])
def test_malformed_overrides(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_overrides(args)


def test_override_below_a_scalar_is_refused() -> None:
    with pytest.raises(ConfigError, match="'seed' is 1, not a section"):
        apply_overrides({"seed": 1}, [("seed.value", 2)])


def test_text_keys_keep_the_value_as_written(recipe: Path) -> None:
    cfg = load_recipe(recipe, ["--output_dir", "20240101", "--checkpoint.checkpoint_dir=007",
                               "--step_scheduler.max_steps", "12"])
    assert cfg.output_dir == "20240101"
    assert cfg.checkpoint.checkpoint_dir == "007"  # not the number 7
    assert cfg.step_scheduler.max_steps == 12  # numeric keys are still read as YAML
    cfg = load_recipe(recipe, ["--model.preset", "null", "--model.pretrained_model_name_or_path", str(recipe.parent)])
    assert cfg.model.preset is None  # null unsets a text key


def test_a_number_in_a_text_key_of_the_file_says_to_quote_it(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE + "output_dir: 20240101\n")
    with pytest.raises(ConfigError, match=r"output_dir: expected text, got the number 20240101; write it in quotes"):
        load_recipe(path)
