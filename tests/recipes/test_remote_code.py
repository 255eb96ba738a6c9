"""``model.trust_remote_code`` is the runner's opt-in, never a recipe file's: a shared recipe pointing at a model
directory with its own ``modeling_*.py`` is refused in one line that names the files, and nothing is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from remat.errors import ConfigError
from remat.recipes.loader import load_recipe_data


def _evil_model(tmp_path: Path) -> Path:
    """A model directory whose config maps the auto classes to its own files, each leaving a marker if imported."""
    directory = tmp_path / "evil-model"
    directory.mkdir()
    config = {"model_type": "evil", "architectures": ["EvilForCausalLM"],
              "auto_map": {"AutoConfig": "configuration_evil.EvilConfig",
                           "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}}
    (directory / "config.json").write_text(json.dumps(config))
    for name in ("configuration_evil", "modeling_evil"):
        (directory / f"{name}.py").write_text(f"open({str(tmp_path / ('ran-' + name))!r}, 'w').close()\n")
    return directory


def _recipe(tmp_path: Path, model: Path) -> Path:
    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"pretrained_model_name_or_path": str(model), "trust_remote_code": True},
        "dataset": {"seq_length": 64},
        "step_scheduler": {"global_batch_size": 2, "local_batch_size": 2, "max_steps": 1},
        "output_dir": str(tmp_path / "out"),
    }))
    return path


def test_a_recipe_cannot_switch_on_remote_code(tmp_path: Path) -> None:
    model = _evil_model(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_recipe_data(_recipe(tmp_path, model))
    message = str(info.value)
    assert message.startswith("model.trust_remote_code: set to True in the recipe file")
    assert f"it would run {model / 'configuration_evil.py'}, {model / 'modeling_evil.py'}." in message
    assert "--trust-remote-code" in message and "\n" not in message
    assert not list(tmp_path.glob("ran-*"))


def test_the_command_line_opt_in_is_accepted(tmp_path: Path) -> None:
    """The runner's own ``--trust-remote-code`` (here as the override it becomes) lets the key through."""
    data = load_recipe_data(_recipe(tmp_path, _evil_model(tmp_path)), ["--model.trust_remote_code", "true"])
    assert data["model"]["trust_remote_code"] is True
    false = load_recipe_data(tmp_path / "shared.yaml", ["--model.trust_remote_code", "false"])
    assert false["model"]["trust_remote_code"] is False


def test_the_cli_refuses_in_one_line_and_runs_nothing(tmp_path: Path) -> None:
    model = _evil_model(tmp_path)
    recipe = _recipe(tmp_path, model)
    remat = str(Path(sys.executable).parent / "remat")
    proc = subprocess.run([remat, "finetune", str(recipe)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and "model.trust_remote_code" in proc.stderr
    assert not list(tmp_path.glob("ran-*")) and not (tmp_path / "out").exists()
