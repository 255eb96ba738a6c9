"""The example recipes ship inside the package: listed, copied out, and run by name from any directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from remat.cli import main
from remat.errors import ConfigError
from remat.recipes.loader import load_recipe, read_yaml
from remat.recipes.shipped import copy_recipe, find_recipe, shipped_recipes

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_ships_every_example() -> None:
    shipped = shipped_recipes()
    assert sorted(shipped) == sorted(p.stem for p in (ROOT / "examples").glob("*.yaml"))
    assert shipped["quickstart"].summary.startswith("Quickstart: fine-tune the embedded default model")
    assert all(len(r.summary) <= 100 for r in shipped.values())


def test_a_name_finds_the_shipped_recipe_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert find_recipe("quickstart") == shipped_recipes()["quickstart"].path
    assert find_recipe("quickstart.yaml") == shipped_recipes()["quickstart"].path
    assert load_recipe("quickstart", ["--step_scheduler.max_steps", "3"]).step_scheduler.max_steps == 3
    (tmp_path / "quickstart").write_text("model: {preset: tiny-llama}\n")  # a file of that name wins
    assert find_recipe("quickstart") == Path("quickstart")
    with pytest.raises(ConfigError, match=r"recipe 'nosuch' not found: not a file, nor a shipped recipe; shipped: "
                                          r"ddp_quickstart, fsdp2_quickstart, llama_3_2_1b_seed, long_context, long_context_cp, quickstart"):
        find_recipe("nosuch")


def test_copy_writes_the_file_and_refuses_to_replace_one(tmp_path: Path) -> None:
    written = copy_recipe("quickstart", tmp_path)
    assert written == tmp_path / "quickstart.yaml"
    assert written.read_text() == (ROOT / "examples" / "quickstart.yaml").read_text()
    with pytest.raises(ConfigError, match="already exists; choose another destination or pass --force"):
        copy_recipe("quickstart", tmp_path)
    written.write_text("# edited\n")
    copy_recipe("quickstart", written, overwrite=True)
    assert written.read_text().startswith("# Quickstart")
    with pytest.raises(ConfigError, match="the directory .* does not exist"):
        copy_recipe("quickstart", tmp_path / "missing" / "r.yaml")


def test_recipes_command_lists_and_copies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert "quickstart         Quickstart:" in out and "remat finetune NAME" in out
    assert main(["recipes", "copy", "ddp_quickstart", str(tmp_path)]) == 0
    assert (tmp_path / "ddp_quickstart.yaml").is_file()
    assert main(["recipes", "copy"]) == 2
    assert "which recipe?" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "message"), [
    (b"model: \xff\xfe\n", r"is not UTF-8 text \(byte 0xff at offset 7\)"),
    (b"\x00\x01binary", r"is not valid YAML|the top level must be a mapping"),
])
def test_unreadable_recipe_files_are_one_line(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "r.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        read_yaml(path)
    with pytest.raises(ConfigError, match="is not a file"):
        read_yaml(tmp_path)
    if os.geteuid() != 0:
        path.write_text("model: {}\n")
        path.chmod(0)
        with pytest.raises(ConfigError, match="cannot be read: Permission denied"):
            read_yaml(path)


def test_a_copied_recipe_in_the_current_directory_wins_over_the_shipped_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`remat recipes copy quickstart`, edit, `remat finetune quickstart`: the edited copy runs, and is named."""
    monkeypatch.chdir(tmp_path)
    copy_recipe("quickstart", tmp_path)
    assert find_recipe("quickstart") == Path("quickstart.yaml")
    assert find_recipe("ddp_quickstart") == shipped_recipes()["ddp_quickstart"].path  # no copy here: the shipped one
