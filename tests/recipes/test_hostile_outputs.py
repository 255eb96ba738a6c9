"""A run never writes through a link planted in its directories, and paths no file system takes are one line: each
case is refused before anything is built, naming the file, and the file the link names is left as it was."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from processes import within
from test_finetune import tiny_recipe

from remat._files import open_append, open_regular, write_atomic
from remat.errors import ConfigError
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe


def _planted(tmp_path: Path, name: str, plant: Callable[[Path, Path], object]) -> tuple[Path, Path]:
    """A victim file outside the run, and ``run/name`` planted to it (``plant(path, victim)``)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path = tmp_path / "run" / name
    path.parent.mkdir(parents=True)
    plant(path, victim)
    return victim, path


@pytest.mark.parametrize(("name", "what"), [
    ("report.png", "run report"),
    (".remat.lock", "run lock"),
    ("metrics.jsonl", "logging.metrics_file"),
    ("wandb_run_id", "logging.wandb run id file"),
    ("checkpoints/latest", "checkpoint pointer"),
    ("checkpoints/.remat.lock", "run lock"),
])
def test_a_planted_link_in_the_output_directory_is_refused(name: str, what: str, tmp_path: Path) -> None:
    victim, link = _planted(tmp_path, name, Path.symlink_to)
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
    ("red\x1b[31m", "red\\x1b[31m' holds control characters"),
])
def test_paths_no_file_system_takes_are_one_line(output_dir: str, message: str, tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, output_dir=str(tmp_path / output_dir))
    with pytest.raises(ConfigError) as info:
        FinetuneRecipe(validate_recipe(recipe))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's zip writer reports ENOSPC as a RuntimeError without an errno: the run names the checkpoint directory
    and the bytes a checkpoint needs, and the previous checkpoint stays complete."""
    import torch

    from remat.errors import MachineFault
    from remat.training_state import find_latest_checkpoint
    from remat.training_state import single as single_state

    real_save = torch.save

    def save(obj: object, path: object, *args: object, **kwargs: object) -> None:
        if ".tmp-step_4-" in str(path):  # the second checkpoint finds the disk full
            raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                               "data/0: file write failed")
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(single_state.torch, "save", save)
    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 4, "ckpt_every_steps": 2})
    with pytest.raises(MachineFault) as info:
        FinetuneRecipe(validate_recipe(recipe)).run()
    message = str(info.value)
    assert message.startswith(f"no space left on the device holding {str(tmp_path / 'run' / 'checkpoints')!r}: "
                              "needs ") and " free; " in message and "\n" not in message
    latest = find_latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert latest is not None and latest.name == "step_2"


def test_torch_s_short_write_when_the_disk_fills_inside_torch_save_is_recognised() -> None:
    """The trial's full disk inside ``torch.save`` of the optimizer: torch's zip writer says only "unexpected pos"."""
    from remat._files import is_disk_full

    assert is_disk_full(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1536 vs 1477"))
    assert not is_disk_full(RuntimeError("unexpected pos in a user's own message"))


def test_a_full_disk_on_another_rank_of_a_sharded_save_is_recognised() -> None:
    """torch.distributed.checkpoint wraps each rank's error in a CheckpointException (a BaseException)."""
    import errno
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from remat._files import is_disk_full

    full = CheckpointException("save", {1: (OSError(errno.ENOSPC, "No space left on device"), traceback.StackSummary())})
    other = CheckpointException("save", {1: (ValueError("shape"), traceback.StackSummary())})
    assert is_disk_full(full) and not is_disk_full(other)


@pytest.mark.parametrize(("name", "what"), [
    (".remat.lock", "run lock"),
    ("metrics.jsonl", "logging.metrics_file"),
    ("checkpoints/.remat.lock", "run lock"),
])
def test_a_planted_hard_link_in_the_output_directory_is_refused(name: str, what: str, tmp_path: Path) -> None:
    """A file with a second name outside the run is never written in place (the lock's JSON, a metrics row)."""
    victim, planted = _planted(tmp_path, name, lambda path, target: os.link(target, path))
    with pytest.raises(ConfigError, match=rf"^{what} '.*{planted.name}' has 2 names \(hard links\); remat never "
                                          "writes in place a file that another name shares"):
        FinetuneRecipe(validate_recipe(tiny_recipe(tmp_path)))
    with pytest.raises(ConfigError, match="has 2 names"):
        open_append(planted, what)
    assert victim.read_text() == "precious\n"
    write_atomic(planted, "renamed over", what)  # a new file renamed over the name: the other name keeps its text
    assert victim.read_text() == "precious\n" and planted.read_text() == "renamed over"


def test_a_planted_checkpoints_directory_link_is_refused(tmp_path: Path) -> None:
    """output_dir/checkpoints linked to a directory outside the run: no checkpoint is written there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ConfigError, match=r"^checkpoint.checkpoint_dir '.*checkpoints' is a symbolic link \(to "
                                          r"'.*outside'\) inside output_dir; remat does not write through links"):
        FinetuneRecipe(validate_recipe(tiny_recipe(tmp_path)))
    assert list(outside.iterdir()) == []
