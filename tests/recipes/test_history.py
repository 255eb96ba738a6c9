"""History is kept: a resume from an older checkpoint refuses or archives the newer ones (byte for byte), pruning
counts only the current line, metrics rows carry attempt ids that the report follows, and leaked temporary files of
dead processes are cleaned."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from remat.cli import main as cli_main
from remat.errors import ConfigError
from remat.recipes.finetune import FinetuneRecipe, RunResult
from remat.recipes.loader import validate_recipe
from remat.recipes.reports.run_report import current_line
from remat.training_state.history import check_saved_step
from remat.training_state.layout import prune, remove_stale_work_dirs, write_marker
from test_finetune import tiny_recipe


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "remat-cache"))


def run(recipe: dict[str, Any]) -> RunResult:
    return FinetuneRecipe(validate_recipe(recipe)).run()


def digests(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def six_steps(tmp_path: Path, **checkpoint: Any) -> dict[str, Any]:
    return tiny_recipe(tmp_path, step_scheduler={"max_steps": 6, "ckpt_every_steps": 2},
                       checkpoint={"keep_last": 2, **checkpoint})


@pytest.fixture
def trained(tmp_path: Path) -> tuple[Path, dict[str, dict[str, str]]]:
    """A run of 6 steps with step_2 kept aside (keep_last 2 leaves step_4 and step_6), and its files' digests."""
    recipe = six_steps(tmp_path, keep_last=None)
    run(recipe)
    ckpt = Path(recipe["output_dir"]) / "checkpoints"
    return ckpt, {name: digests(ckpt / name) for name in ("step_2", "step_4", "step_6")}


def test_an_older_resume_is_refused_and_touches_nothing(tmp_path: Path,
                                                         trained: tuple[Path, dict[str, dict[str, str]]]) -> None:
    ckpt, before = trained
    metrics = (ckpt.parent / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError) as err:
        run(six_steps(tmp_path, keep_last=None, resume=str(ckpt / "step_2")))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint.resume: {ckpt / 'step_2'} is older than step_4, step_6 in {ckpt}; "
                              "training from it would replace them. Allowed: resume the newest")
    assert "checkpoint.on_newer_checkpoints: archive" in message
    assert {name: digests(ckpt / name) for name in before} == before
    assert (ckpt / "latest").read_text() == "step_6\n"
    assert (ckpt.parent / "metrics.jsonl").read_bytes() == metrics  # nothing trained, nothing logged


def test_archive_keeps_the_newer_steps_byte_identical_and_trains_a_new_line(
        tmp_path: Path, trained: tuple[Path, dict[str, dict[str, str]]], capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, before = trained
    capsys.readouterr()
    result = run(six_steps(tmp_path, keep_last=2, resume=str(ckpt / "step_2"), on_newer_checkpoints="archive"))
    out = capsys.readouterr().out
    archive = ckpt / "archive" / "attempt-2"
    assert f"checkpoint.on_newer_checkpoints: archive: moved step_4, step_6 to {archive} (untouched)" in out
    assert [r.step for r in result.records] == [3, 4, 5, 6]
    assert {name: digests(archive / name) for name in ("step_4", "step_6")} == {k: before[k] for k in ("step_4",
                                                                                                      "step_6")}
    note = json.loads((archive / "ARCHIVED.json").read_text())
    assert (note["archived"], note["latest_was"], note["attempt"]) == (["step_4", "step_6"], "step_6", 2)
    # The new line: keep_last 2 pruned step_2 but never the archive; latest names the new step_6.
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == ["step_4", "step_6"]
    assert (ckpt / "latest").read_text() == "step_6\n"
    assert digests(ckpt / "step_6") != before["step_6"]
    # Metrics: attempt 1 logged steps 1-6, attempt 2 steps 3-6; the report follows attempt 2 from step 3 on.
    rows = [json.loads(line) for line in (ckpt.parent / "metrics.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["step"]) for r in rows] == [(1, s) for s in range(1, 7)] + [(2, s) for s in range(3, 7)]
    assert cli_main(["report", str(ckpt.parent)]) == 0
    assert "trained steps 1-6" in capsys.readouterr().out


def test_prune_counts_only_the_current_line(tmp_path: Path) -> None:
    for step in (1, 2, 6):
        directory = tmp_path / f"step_{step}"
        directory.mkdir()
        (directory / "weights.bin").write_bytes(b"x" * step)
        write_marker(directory, step, peft=False)
    (tmp_path / "archive" / "attempt-2" / "step_9").mkdir(parents=True)
    (tmp_path / "step_3").mkdir()
    (tmp_path / "step_3" / "weights.bin").write_bytes(b"y")
    write_marker(tmp_path / "step_3", 3, peft=False)
    prune(tmp_path, 2, keep=tmp_path / "step_3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["archive", "step_2", "step_3", "step_6"]


def test_report_follows_the_latest_attempt() -> None:
    def row(attempt: int | None, step: int, loss: float, kind: str = "train") -> dict[str, Any]:
        return {"kind": kind, "step": step, "loss": loss, **({"attempt": attempt} if attempt is not None else {})}

    # Attempt 1 trained 1-6 and crashed after its step_4 save; attempt 2 resumed at 4 and trained 5-8; attempt 3
    # resumed from step_2 (an archived line) and trained 3-4. Validation rows follow the same line.
    rows = ([row(1, s, 10.0 + s) for s in range(1, 7)] + [row(1, 6, 9.0, "validation")]
            + [row(2, s, 20.0 + s) for s in range(5, 9)] + [row(2, 6, 8.0, "validation")]
            + [row(3, s, 30.0 + s) for s in (3, 4)])
    kept = current_line(rows)
    assert [(r["kind"], r["step"], r["loss"]) for r in kept] == [("train", 1, 11.0), ("train", 2, 12.0),
                                                                 ("train", 3, 33.0), ("train", 4, 34.0)]
    kept = current_line(rows[:-2])
    assert [(r["step"], r["loss"]) for r in kept if r["kind"] == "train"] == [
        (1, 11.0), (2, 12.0), (3, 13.0), (4, 14.0), (5, 25.0), (6, 26.0), (7, 27.0), (8, 28.0)]
    assert [(r["step"], r["loss"]) for r in kept if r["kind"] == "validation"] == [(6, 8.0)]
    # Files written before attempt ids: the last row of each step wins, as before.
    legacy = [row(None, 1, 1.0), row(None, 2, 2.0), row(None, 2, 3.0)]
    assert [r["loss"] for r in current_line(legacy)] == [1.0, 3.0]


def test_leaked_temporary_files_of_dead_processes_are_removed(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 2})
    run(recipe)
    ckpt = Path(recipe["output_dir"]) / "checkpoints"
    (ckpt / ".latest.tmp-99999999").write_text("step_9\n")  # killed between writing it and the rename
    (ckpt / ".tmp-step_4-99999999").mkdir()  # killed while writing a checkpoint
    alive = ckpt / f".latest.tmp-{os.getppid()}"  # a live process's: left alone
    alive.write_text("step_2\n")
    assert run(recipe).records == []  # already at max_steps: saves nothing, yet cleans at its start
    assert {p.name for p in ckpt.iterdir() if p.name.startswith(".")} == {".remat.lock", alive.name}
    alive.unlink()
    (ckpt / ".latest.tmp-4294967296999").write_text("")  # a pid beyond any pid_max
    remove_stale_work_dirs(ckpt)
    assert not (ckpt / ".latest.tmp-4294967296999").exists()


def test_a_train_state_whose_step_disagrees_with_its_directory_is_refused(tmp_path: Path) -> None:
    assert check_saved_step(tmp_path / "step_4", 4) == 4
    with pytest.raises(ConfigError, match=r"^checkpoint\.resume: .*step_4/train_state\.json records step 2, but the "
                                          r"checkpoint is step_4; it was edited or mixed up"):
        check_saved_step(tmp_path / "step_4", 2)
