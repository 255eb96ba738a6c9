"""Out-of-memory notes (`remat.adaptation.oom_notes`): what a rank of several that ran out of memory
leaves for the restarted run, which note a restart re-plans from, which are stale, and that ``--restart`` moves
them aside with the checkpoints; and the launcher's default ``--max-restarts`` under ``auto``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from remat.commands.finetune import restarts_for_replanning
from remat.distributed.launch import LaunchOptions
from remat.recipes.loader import validate_recipe
from remat.adaptation.oom_notes import (
    OutOfMemoryNote,
    clear_notes,
    note_path,
    pending_note,
    read_notes,
    restarts_left,
    write_note,
)
from remat.training_state.verify import supersede_checkpoints


def note(step: int, *, rank: int = 1, replans: int = 0, generation: int = 0) -> OutOfMemoryNote:
    return OutOfMemoryNote(step=step, rank=rank, error="CUDA out of memory", first_update=False, replans=replans,
                           budget_bytes=1000, planner={"policy": {"mode": "none"}}, generation=generation)


def test_a_note_round_trips_and_the_newest_pending_one_is_chosen(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    first = write_note(root, note(5, rank=0))
    assert first == note_path(root, 0) and first.name == "oom-replan-rank0.json"
    write_note(root, note(5, rank=1, replans=1, generation=1))  # the restarted run re-planned, then failed again
    assert sorted(n.rank for _, n in read_notes(root)) == [0, 1]
    assert pending_note(root, resumed_step=3) == note(5, rank=1, replans=1, generation=1)
    assert len(read_notes(root)) == 2  # pending notes stay until a checkpoint after them carries the re-plan


def test_notes_at_or_before_the_resumed_step_are_stale_and_removed(tmp_path: Path) -> None:
    write_note(tmp_path, note(4, rank=0))
    write_note(tmp_path, note(6, rank=1))
    assert pending_note(tmp_path, resumed_step=4) == note(6, rank=1)
    assert [n.rank for _, n in read_notes(tmp_path)] == [1]
    assert pending_note(tmp_path, resumed_step=6) is None
    assert read_notes(tmp_path) == [] and pending_note(tmp_path / "missing", resumed_step=0) is None


def test_an_unreadable_note_is_skipped_with_a_warning_and_cleared_at_the_end(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    note_path(tmp_path, 3).write_text("{not json")
    write_note(tmp_path, note(2))
    assert pending_note(tmp_path, resumed_step=0) == note(2)
    assert "skipping the out-of-memory note" in caplog.text and "oom-replan-rank3.json" in caplog.text
    clear_notes(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_restart_moves_the_notes_aside_with_the_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "step_2").mkdir()
    write_note(tmp_path, note(3))
    moved = supersede_checkpoints(tmp_path)
    assert moved is not None and sorted(p.name for p in moved.iterdir()) == ["oom-replan-rank1.json", "step_2"]
    assert pending_note(tmp_path, resumed_step=0) is None


@pytest.mark.parametrize(("environ", "left"), [
    ({}, None), ({"TORCHELASTIC_MAX_RESTARTS": "3"}, 3),
    ({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "2"}, 1),
    ({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "1"}, 0),
])
def test_restarts_left_reads_torchruns_environment(environ: dict[str, str], left: int | None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert restarts_left() == left


def options(*flags: str) -> LaunchOptions:
    parser = argparse.ArgumentParser()
    from remat.distributed.launch import add_launch_arguments

    add_launch_arguments(parser)
    return LaunchOptions.from_namespace(parser.parse_args(list(flags)))


def cfg(planned: bool = True, **auto: Any) -> Any:
    setting = {"mode": "auto", **auto} if planned else "full"
    return validate_recipe({"model": {"preset": "tiny-llama"},
                            "distributed": {"strategy": "ddp", "activation_checkpointing": setting}})


def test_auto_on_several_processes_restarts_up_to_max_replans_unless_told_otherwise() -> None:
    assert restarts_for_replanning(options("--nproc-per-node", "2"), cfg()).max_restarts == 3
    assert restarts_for_replanning(options("--nproc-per-node", "2"), cfg(max_replans=5)).max_restarts == 5
    assert restarts_for_replanning(options("--nproc-per-node", "auto"), cfg()).max_restarts == 3
    for given, recipe in ((options("--nproc-per-node", "2", "--max-restarts", "0"), cfg()),
                          (options("--nproc-per-node", "2"), cfg(planned=False)),
                          (options("--nproc-per-node", "2"), cfg(max_replans=0)),
                          (options("--nproc-per-node", "1"), cfg())):
        assert restarts_for_replanning(given, recipe) == given
