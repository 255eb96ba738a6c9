"""Hostile recipes: loading, validating or building one never runs anything outside what the allow-list means.

Every target below names a way to reach the shell, the interpreter, the file system or the network through an allowed
package's globals, a private name, a re-exported module, or an allowed function of the wrong kind. Each is given
arguments that would create a file if it ran; the tests assert the one-line error and that no file appeared.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from remat.errors import ConfigError
from remat.recipes.loader import load_recipe, validate_recipe
from remat.recipes.targets import LOSS, OPTIMIZER, build_target

BASE: dict[str, Any] = {
    "model": {"preset": "tiny-llama"},
    "dataset": {"seq_length": 64},
    "step_scheduler": {"global_batch_size": 4, "local_batch_size": 2, "max_steps": 3},
}

SHELL = {"command": "touch PWNED"}

# (target, fragment of the error) for targets that would run a command or load a file if they were called.
HOSTILE: list[tuple[str, str]] = [
    ("torch.os.system", "reaches the module 'os' through an attribute of 'torch'"),
    ("remat.os.system", "os'"),  # remat's __init__ no longer imports os: no such module, never imported
    ("peft.os.system", "os'"),  # reached through an attribute, or no such module: never imported either way
    ("transformers.os.system", "os'"),
    ("torch.serialization.os.system", "reaches the module 'os'"),
    ("torch.optim.adamw.torch.load", "'torch.optim.adamw.torch'"),
    ("remat.recipes.targets.importlib.import_module", "reaches the module 'importlib'"),
    ("os.system", "outside the allowed packages"),
    ("subprocess.run", "outside the allowed packages"),
    ("builtins.exec", "outside the allowed packages"),
    ("builtins.eval", "outside the allowed packages"),
    ("importlib.import_module", "outside the allowed packages"),
    ("pickle.loads", "outside the allowed packages"),
    ("torch.optim.AdamW.__init__", "private attribute '__init__'"),
    ("torch.optim.__builtins__", "private attribute '__builtins__'"),
    ("torch._C._get_tracing_state", "private attribute '_C'"),
    ("torch.load", "is not"),
    ("torch.save", "is not"),
    ("torch.hub.load", "is not"),
    ("torch.utils.cpp_extension.load_inline", "is not"),
    ("torch.distributed.run.main", "is not"),
    ("transformers.pipeline", "is not"),
    ("remat.cli.main", "is not"),
    ("torch.optim", "is a module"),
    ("torch.nn.CrossEntropyLoss", "is not"),  # for loss_fn: a torch loss does not follow the recipe's contract
]


def _recipe(section: str, target: str) -> dict[str, Any]:
    data: dict[str, Any] = {key: dict(value) for key, value in BASE.items()}
    data[section] = {"_target_": target, **SHELL}
    return data


@pytest.mark.parametrize("section", ["loss_fn", "optimizer"])
@pytest.mark.parametrize(("target", "fragment"), HOSTILE, ids=[t for t, _ in HOSTILE])
def test_validation_refuses_and_runs_nothing(section: str, target: str, fragment: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        validate_recipe(_recipe(section, target))
    message = str(info.value)
    assert message.startswith(f"{section}._target_: {target!r}") or message.startswith(f"{section}._target_: cannot")
    if not (section == "optimizer" and target == "torch.nn.CrossEntropyLoss"):
        assert fragment in message
    assert "\n" not in message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("target", "fragment"), HOSTILE, ids=[t for t, _ in HOSTILE])
def test_build_refuses_and_runs_nothing(target: str, fragment: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for key, kind in (("loss_fn._target_", LOSS), ("optimizer._target_", OPTIMIZER)):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            build_target(target, dict(SHELL), key=key, kind=kind)
    assert list(tmp_path.iterdir()) == []


def test_the_right_kind_is_required_for_each_key() -> None:
    with pytest.raises(ConfigError, match="optimizer._target_: 'remat.loss.MaskedCrossEntropy' is not an optimizer"):
        validate_recipe(_recipe("optimizer", "remat.loss.MaskedCrossEntropy") | {"optimizer": {
            "_target_": "remat.loss.MaskedCrossEntropy"}})
    with pytest.raises(ConfigError, match="loss_fn._target_: 'torch.optim.AdamW' is not a loss class that declares"):
        validate_recipe(BASE | {"loss_fn": {"_target_": "torch.optim.AdamW"}})
    ok = validate_recipe(BASE | {"optimizer": {"_target_": "torch.optim.SGD", "lr": 0.1},
                                 "loss_fn": {"_target_": "remat.loss.masked.MaskedCrossEntropy"}})
    assert ok.optimizer.target == "torch.optim.SGD"


@pytest.mark.parametrize("package", ["os", "subprocess", "builtins", "importlib", "_private", "os.path", "a b"])
def test_the_runner_cannot_trust_the_standard_library(package: str) -> None:
    with pytest.raises(ConfigError, match="custom_target_packages"):
        validate_recipe(BASE | {"custom_target_packages": [package]})


def test_trusting_a_package_keeps_the_other_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "trusted_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("import os\nfrom os import system\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    trusted = {"custom_target_packages": ["trusted_pkg"]}
    with pytest.raises(ConfigError, match="reaches the module 'os'"):
        validate_recipe(_recipe("loss_fn", "trusted_pkg.os.system") | trusted)
    with pytest.raises(ConfigError, match="defined in 'posix'.*only re-exported by 'trusted_pkg'"):
        validate_recipe(_recipe("loss_fn", "trusted_pkg.system") | trusted)
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("tagged", [
    "!!python/object/apply:os.system [touch PWNED]",
    "!!python/name:os.system",
    "!!python/object/new:subprocess.Popen [[touch, PWNED]]",
])
def test_yaml_tags_are_never_constructed(tagged: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE) + f"seed: {tagged}\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_recipe(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_a_recipe_file_cannot_open_the_allow_list_for_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for key, value in (("allow_custom_targets", True), ("custom_target_packages", ["os"])):
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(_recipe("loss_fn", "os.system") | {key: value}))
        with pytest.raises(ConfigError, match=f"{key}: set in the recipe file .* cannot widen the _target_ allow-list"):
            load_recipe(path)
        path.unlink()
    assert list(tmp_path.iterdir()) == []


def test_the_cli_prints_one_line_and_runs_nothing(tmp_path: Path) -> None:
    """The exact recipe from the report, through `remat finetune`: exit 2, one line, no file."""
    path = tmp_path / "shared.yaml"
    path.write_text(yaml.safe_dump(BASE | {"loss_fn": {"_target_": "torch.os.system", "command": "touch PWNED"}}))
    proc = subprocess.run([sys.executable, "-m", "remat.cli", "finetune", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: loss_fn._target_: 'torch.os.system' reaches the module 'os'"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.yaml"]
