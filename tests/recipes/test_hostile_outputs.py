"""A run never writes through a link planted in its directories, and paths no file system takes are one line: each
case is refused before anything is built, naming the file, and the file the link names is left as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from processes import within
from test_finetune import tiny_recipe

from remat._files import open_append, open_regular, write_atomic
from remat.errors import ConfigError
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe


@pytest.mark.parametrize(("name", "what"), [
    ("report.png", "run report"),
    (".remat.lock", "run lock"),
    ("metrics.jsonl", "logging.metrics_file"),
    ("wandb_run_id", "logging.wandb run id file"),
    ("checkpoints/latest", "checkpoint pointer"),
    ("checkpoints/.remat.lock", "run lock"),
])
def test_a_planted_link_in_the_output_directory_is_refused(name: str, what: str, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    link = tmp_path / "run" / name
    link.parent.mkdir(parents=True)
    link.symlink_to(victim)
    with pytest.raises(ConfigError) as info:
        FinetuneRecipe(validate_recipe(tiny_recipe(tmp_path)))
    assert str(info.value).startswith(f"{what} {str(link)!r} is a symbolic link (to {str(victim)!r}); remat does "
                                      "not write through links")
    assert victim.read_text() == "precious\n"


def test_a_fifo_where_the_run_writes_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / "report.png")
    with within(10), pytest.raises(ConfigError, match=r"run report '.*report.png' is a FIFO \(named pipe\)"):
        FinetuneRecipe(validate_recipe(tiny_recipe(tmp_path)))


def test_writes_never_follow_a_link(tmp_path: Path) -> None:
    """The helpers every owned file goes through, checked on their own: the link is named, the victim untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        write_atomic(tmp_path / "link", "overwritten", "checkpoint pointer")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        open_append(tmp_path / "link", "logging.metrics_file")
    # A link planted at the temporary name itself is replaced, not followed.
    (tmp_path / f".target.tmp-{os.getpid()}").symlink_to(victim)
    write_atomic(tmp_path / "target", "mine", "checkpoint pointer")
    assert (tmp_path / "target").read_text() == "mine" and victim.read_text() == "precious"


def test_reads_of_a_fifo_or_device_never_block(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with within(10):
        with pytest.raises(ConfigError, match=r"recipe .*fifo' is a FIFO \(named pipe\); allowed: a regular file"):
            open_regular(tmp_path / "fifo", "recipe")
        with pytest.raises(ConfigError, match="is a character device; allowed: a regular file"):
            open_regular("/dev/zero", "dataset file")


@pytest.mark.parametrize(("output_dir", "message"), [
    ("out\x00put", "out\\x00put' holds a NUL byte, which no path can"),
    ("a" * 300, "output_dir: the part 'aaaa"),
])
def test_paths_no_file_system_takes_are_one_line(output_dir: str, message: str, tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, output_dir=str(tmp_path / output_dir))
    with pytest.raises(ConfigError) as info:
        FinetuneRecipe(validate_recipe(recipe))
    assert message in str(info.value) and "\n" not in str(info.value)
