"""Paths a run cannot write are one line naming the key, before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.errors import ConfigError
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe
from remat.recipes.run_safety.output_paths import OutputPaths, check_writable_dir


def _paths(root: Path, metrics: str | None = "metrics.jsonl", checkpoint_dir: str | None = None) -> OutputPaths:
    return OutputPaths.of(str(root), checkpoint_dir, True, metrics)


def test_writable_paths_pass_and_nothing_is_created(tmp_path: Path) -> None:
    _paths(tmp_path / "run", metrics="logs/m.jsonl").check()
    assert list(tmp_path.iterdir()) == []  # made when the run first writes there


@pytest.mark.parametrize(("make", "message"), [
    (lambda t: _paths(t / "file"), r"output_dir: '.*file' is the regular file '.*file', not a directory"),
    (lambda t: _paths(t / "file" / "run"), r"output_dir: '.*run' is under the regular file '.*file'"),
    (lambda t: _paths(t / "ok", checkpoint_dir=str(t / "file" / "ckpt")),
     r"checkpoint.checkpoint_dir: '.*ckpt' is under the regular file"),
    (lambda t: _paths(t / "ok", metrics="afile/m.jsonl"), r"logging.metrics_file: '.*afile' is the regular file"),
    (lambda t: _paths(t / "ok", metrics="sub"), r"logging.metrics_file: '.*sub' exists and is not a file"),
])
def test_unwritable_paths_name_the_key(tmp_path: Path, make, message: str) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "ok" / "sub").mkdir(parents=True)
    (tmp_path / "ok" / "afile").write_text("x")
    with pytest.raises(ConfigError, match=message):
        make(tmp_path).check()


@pytest.mark.parametrize(("read_only", "reason"), [
    (True, "the file system is read-only"), (False, "permission denied on '.*'"),
])
def test_unwritable_directories_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_only: bool,
                                              reason: str) -> None:
    import os

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    flags = os.statvfs(tmp_path).f_flag
    statvfs = type("StatVFS", (), {"f_flag": flags | os.ST_RDONLY if read_only else flags & ~os.ST_RDONLY})
    monkeypatch.setattr(os, "statvfs", lambda path: statvfs)
    with pytest.raises(ConfigError, match=rf"^output_dir: cannot write to '.*new': {reason}"):
        check_writable_dir(tmp_path / "new", "output_dir")


def test_the_recipe_checks_its_paths_before_building_anything(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    cfg = validate_recipe({"model": {"preset": "tiny-llama"}, "output_dir": str(tmp_path / "file")})
    with pytest.raises(ConfigError, match="output_dir: .* is the regular file"):
        FinetuneRecipe(cfg)


@pytest.mark.parametrize("metrics_file", ["/elsewhere/file", "../../escape.jsonl", "logs/../../x.jsonl", "~/m.jsonl",
                                          ""])
def test_a_metrics_file_outside_the_run_is_refused_at_load(metrics_file: str, tmp_path: Path) -> None:
    """A recipe writes only in its run's directory: logging.metrics_file is a relative path without '..'."""
    with pytest.raises(ConfigError, match=r"logging.metrics_file: a recipe writes only in its run's directory; "
                                          r"allowed: a file name inside output_dir"):
        validate_recipe({"model": {"preset": "tiny-llama"}, "output_dir": str(tmp_path / "run"),
                         "logging": {"metrics_file": metrics_file}})
    assert not (tmp_path / "run").exists()
