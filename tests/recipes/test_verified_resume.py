"""Verified resume: a same-size corruption of any checkpoint file (or a garbage ``latest``) is detected and the
previous checkpoint used, said in one log line each; a checkpoint that verifies but fails to load leaves nothing of
itself behind; all checkpoints broken stops with one line and changes nothing; ``restart`` moves them aside."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_finetune import run, tiny_recipe

from remat.errors import ConfigError
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe
from remat.training_state.layout import COMPLETE_MARKER

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "remat-cache"))


def _recipe(base: Path) -> dict[str, Any]:
    return tiny_recipe(base, step_scheduler={"max_steps": 4, "ckpt_every_steps": 2})


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints step_2 and step_4 (the base directory of its output_dir ``run``)."""
    base = tmp_path_factory.mktemp("trained")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REMAT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "remat-cache"))
        run(_recipe(base))
    return base


@pytest.fixture
def copy_of_run(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path


def _checkpoints(base: Path) -> Path:
    return base / "run" / "checkpoints"


def _flip(file: Path, offset: int) -> None:
    """Change one byte in place (the file keeps its size)."""
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x5A
    file.write_bytes(bytes(data))


def _resume(base: Path, **checkpoint: Any) -> FinetuneRecipe:
    recipe = _recipe(base)
    recipe["checkpoint"] = {**recipe["checkpoint"], **checkpoint}
    job = FinetuneRecipe(validate_recipe(recipe))
    job.setup()
    return job


def _snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_holds_step_2(job: FinetuneRecipe, checkpoints: Path) -> None:
    assert job.resumed_from == checkpoints / "step_2" and job.step == 2
    saved = load_file(checkpoints / "step_2" / "model" / "model.safetensors")
    current = job.model.state_dict()
    assert all(torch.equal(current[name], tensor) for name, tensor in saved.items())
    saved_optimizer = torch.load(checkpoints / "step_2" / "optimizer.pt", weights_only=True)
    assert saved_optimizer["state"].keys() == job.optimizer.state_dict()["state"].keys()
    for key, state in saved_optimizer["state"].items():
        assert torch.equal(state["exp_avg"], job.optimizer.state_dict()["state"][key]["exp_avg"])
    assert job.lr_scheduler.last_epoch == 2


CORRUPTIONS = {
    "model tensor data": ("model/model.safetensors", -7),
    "model safetensors header": ("model/model.safetensors", 12),
    "optimizer.pt": ("optimizer.pt", 900),
    "rng_state.pt": ("rng_state.pt", 300),
    "scheduler.pt": ("scheduler.pt", 200),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_same_size_corruption_falls_back_to_the_previous_checkpoint(
        kind: str, copy_of_run: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoints = _checkpoints(copy_of_run)
    rel, offset = CORRUPTIONS[kind]
    _flip(checkpoints / "step_4" / rel, offset)
    recorded = json.loads((checkpoints / "step_4" / COMPLETE_MARKER).read_text())["files"][rel]["sha256"]
    actual = hashlib.sha256((checkpoints / "step_4" / rel).read_bytes()).hexdigest()
    broken_files = _snapshot(checkpoints / "step_4")
    with caplog.at_level(logging.WARNING):
        job = _resume(copy_of_run)
    _assert_holds_step_2(job, checkpoints)
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    assert skipped == [f"skipping checkpoint {checkpoints / 'step_4'}: {rel}: content differs from {COMPLETE_MARKER} "
                       f"(sha256 {actual[:12]}... vs {recorded[:12]}...); trying the next newest"]
    # The skipped checkpoint is kept, byte for byte, where the resumed run's own step_4 cannot replace it.
    (aside,) = [p for p in checkpoints.iterdir() if p.name.startswith(".broken-")]
    assert _snapshot(aside / "step_4") == broken_files and not (checkpoints / "step_4").exists()
    assert (checkpoints / "latest").read_text() == "step_2\n"
    assert f"kept the skipped checkpoints step_4, unchanged, in {aside}; latest now names step_2" in caplog.text


def test_a_hand_edited_train_state_is_detected(copy_of_run: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoints = _checkpoints(copy_of_run)
    state_file = checkpoints / "step_4" / "train_state.json"
    state_file.write_text(state_file.read_text().replace('"step": 4', '"step": 5'))  # valid JSON, same size
    with caplog.at_level(logging.WARNING):
        job = _resume(copy_of_run)
    _assert_holds_step_2(job, checkpoints)
    assert f"skipping checkpoint {checkpoints / 'step_4'}: train_state.json: content differs" in caplog.text


def test_a_garbage_latest_pointer_is_said_and_the_newest_verified_checkpoint_used(
        copy_of_run: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoints = _checkpoints(copy_of_run)
    (checkpoints / "latest").write_bytes(b"\xff\xfe\x00garbage\x9c")
    with caplog.at_level(logging.WARNING):
        job = _resume(copy_of_run)
    assert job.resumed_from == checkpoints / "step_4" and job.step == 4
    assert (f"{checkpoints / 'latest'} is unreadable (UnicodeDecodeError); trying the newest checkpoint that "
            "verifies") in caplog.text


def _set_latest(checkpoints: Path, name: str, *, seconds_after_step_4: float) -> None:
    """Point ``latest`` at `name`, written `seconds_after_step_4` after step_4's marker (negative: before it)."""
    (checkpoints / "latest").write_text(name + "\n")
    when = (checkpoints / "step_4" / COMPLETE_MARKER).stat().st_mtime_ns + int(seconds_after_step_4 * 1e9)
    os.utime(checkpoints / "latest", ns=(when, when))


def test_a_step_published_after_latest_was_written_is_resumed_first(
        copy_of_run: Path, caplog: pytest.LogCaptureFixture) -> None:
    """kill -9 between publishing step_4 and moving ``latest`` (found by benchmarks/fault_injection.py): ``latest``
    still names step_2, written before step_4 was finished; resuming step_2 would re-train step 4 over a complete
    step_4."""
    checkpoints = _checkpoints(copy_of_run)
    _set_latest(checkpoints, "step_2", seconds_after_step_4=-1.0)
    with caplog.at_level(logging.WARNING):
        job = _resume(copy_of_run)
    assert job.resumed_from == checkpoints / "step_4" and job.step == 4
    assert (f"{checkpoints / 'latest'} names step_2, but step_4 was completed after it was written (a save stopped "
            "before moving it); trying the newest checkpoint that verifies") in caplog.text


def test_latest_moved_back_after_a_newer_step_still_wins(copy_of_run: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    checkpoints = _checkpoints(copy_of_run)
    _set_latest(checkpoints, "step_2", seconds_after_step_4=1.0)
    with caplog.at_level(logging.WARNING):
        job = _resume(copy_of_run)
    assert job.resumed_from == checkpoints / "step_2" and job.step == 2
    assert "was completed after it was written" not in caplog.text


def test_a_load_failure_after_verification_leaves_nothing_half_loaded(
        copy_of_run: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A format-1 (unverified) step_4 whose data position is unusable: its model, optimizer and schedule were
    already loaded when that fails, and the fallback to step_2 replaces all of them."""
    checkpoints = _checkpoints(copy_of_run)
    step_4 = checkpoints / "step_4"
    state = json.loads((step_4 / "train_state.json").read_text())
    del state["data"]
    (step_4 / "train_state.json").write_text(json.dumps(state))
    marker = json.loads((step_4 / COMPLETE_MARKER).read_text())
    files = {rel: (step_4 / rel).stat().st_size for rel in marker["files"]}
    (step_4 / COMPLETE_MARKER).write_text(json.dumps({**marker, "format": 1, "files": files}))
    with caplog.at_level(logging.WARNING):
        job = _resume(copy_of_run)
    _assert_holds_step_2(job, checkpoints)
    assert "sizes checked, contents unverified" in caplog.text
    assert f"skipping checkpoint {step_4}: loading failed with KeyError: 'data'; trying the next newest" in caplog.text


def test_a_format_1_checkpoint_still_resumes_unverified(copy_of_run: Path, caplog: pytest.LogCaptureFixture) -> None:
    step_4 = _checkpoints(copy_of_run) / "step_4"
    marker = json.loads((step_4 / COMPLETE_MARKER).read_text())
    sizes = {rel: entry["size"] for rel, entry in marker["files"].items()}
    (step_4 / COMPLETE_MARKER).write_text(json.dumps({**marker, "format": 1, "files": sizes}))
    with caplog.at_level(logging.WARNING):
        job = _resume(copy_of_run)
    assert job.resumed_from == step_4 and job.step == 4
    assert f"{step_4}: written before content hashes (COMPLETE.json format 1)" in caplog.text


def test_all_checkpoints_broken_stops_with_one_line_and_changes_nothing(copy_of_run: Path) -> None:
    checkpoints = _checkpoints(copy_of_run)
    _flip(checkpoints / "step_4" / "model" / "model.safetensors", -7)
    (checkpoints / "step_2" / "model" / "model.safetensors").write_bytes(b"\0" * 10)  # truncated
    before = _snapshot(copy_of_run)
    with pytest.raises(ConfigError) as raised:
        _resume(copy_of_run)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint.resume: no checkpoint in {checkpoints} verifies and loads: step_4 "
                              "(model/model.safetensors: content differs from COMPLETE.json (sha256 ")
    assert "; step_2 (model/model.safetensors has 10 bytes, COMPLETE.json says " in message
    assert message.endswith(f"; nothing was deleted. To start over, run with --restart (checkpoint.resume: restart "
                            f"moves them into {checkpoints}/.superseded-<time>/) or use a new output_dir")
    assert _snapshot(copy_of_run) == before


def test_a_named_broken_checkpoint_is_refused_without_fallback(copy_of_run: Path) -> None:
    step_4 = _checkpoints(copy_of_run) / "step_4"
    _flip(step_4 / "optimizer.pt", 900)
    with pytest.raises(ConfigError, match=rf"^checkpoint.resume: {step_4} cannot be resumed: optimizer.pt: content "
                                          r"differs from COMPLETE.json \(sha256 .*; nothing was changed"):
        _resume(copy_of_run, resume=str(step_4))


def test_restart_moves_the_old_checkpoints_aside_and_starts_over(copy_of_run: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    checkpoints = _checkpoints(copy_of_run)
    _flip(checkpoints / "step_4" / "model" / "model.safetensors", -7)
    _flip(checkpoints / "step_2" / "model" / "model.safetensors", -7)
    before = {k: v for k, v in _snapshot(checkpoints).items() if k != ".remat.lock"}  # the run lock stays in place
    recipe = _recipe(copy_of_run)
    recipe["checkpoint"] = {**recipe["checkpoint"], "resume": "restart"}
    with caplog.at_level(logging.WARNING):
        job, result = run(recipe)
    assert job.resumed_from is None and [r.step for r in result.records] == [1, 2, 3, 4]
    aside = [p for p in checkpoints.iterdir() if p.name.startswith(".superseded-")]
    assert len(aside) == 1
    assert _snapshot(aside[0]) == before  # every old file kept, byte for byte
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == ["latest", "step_2",
                                                                                            "step_4"]
    assert f"moved the earlier checkpoints of {checkpoints} into {aside[0]}; starting at step 0" in caplog.text
    # The new checkpoints verify and resume; the moved-aside ones are never picked up.
    assert _resume(copy_of_run).resumed_from == checkpoints / "step_4"


def test_restart_refuses_when_the_checkpoints_cannot_be_moved(copy_of_run: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.training_state import verify

    def refuse(src: Any, dst: Any) -> None:
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(verify.os, "replace", refuse)
    before = _snapshot(copy_of_run)
    with pytest.raises(ConfigError, match=rf"^checkpoint.resume: restart cannot move the checkpoints in "
                                          rf"{_checkpoints(copy_of_run)} aside: \[Errno 13\] Permission denied"):
        _resume(copy_of_run, resume="restart")
    assert {k: v for k, v in _snapshot(copy_of_run).items()} == before
