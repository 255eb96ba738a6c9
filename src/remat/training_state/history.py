"""History is kept: a run resumed from an older checkpoint never trains over the newer ones without being told.

Resuming ``step_2`` while ``step_4`` and ``step_6`` exist would save a new ``step_4`` over the old one and move
``latest`` backwards. ``checkpoint.on_newer_checkpoints`` says what to do instead: ``refuse`` (the default) stops
with one line naming the newer steps and the choices; ``archive`` moves them, untouched, into
``<checkpoint_dir>/archive/attempt-<N>/`` (N: the run's attempt number) with a note of why, points ``latest`` at the
resumed checkpoint and says so. Nothing is ever deleted; archived checkpoints are not pruned nor resumed by ``auto``
(resume one by its path, or move it back).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from remat._files import fsync_path, write_atomic
from remat.errors import ConfigError
from remat.training_state.layout import (
    _STEP_DIR,
    LATEST_FILE,
    TRAIN_STATE_FILE,
    _step_of,
    atomic_write_text,
    list_checkpoints,
)

ARCHIVE_DIR = "archive"
ARCHIVE_NOTE = "ARCHIVED.json"


def newer_checkpoints(root: Path, resumed: Path) -> list[Path]:
    """The complete checkpoints directly under ``root`` with a higher step than ``resumed`` (a ``step_<N>``
    directory, here or elsewhere), oldest first; none when ``resumed`` is not named like a checkpoint."""
    match = _STEP_DIR.match(resumed.name)
    if match is None:
        return []
    return [p for p in list_checkpoints(root) if _step_of(p) > int(match.group(1))]


def keep_newer_checkpoints(root: Path, resumed: Path, *, policy: str, attempt: int) -> str | None:
    """Apply ``checkpoint.on_newer_checkpoints`` before resuming ``resumed`` into ``root``: None when nothing newer
    exists, the line to report after archiving, or ConfigError (``refuse``) naming the newer steps and the choices."""
    newer = newer_checkpoints(root, resumed)
    if not newer:
        return None
    names = ", ".join(p.name for p in newer)
    if policy != "archive":
        raise ConfigError(
            f"checkpoint.resume: {resumed} is older than {names} in {root}; training from it would replace them. "
            f"Allowed: resume the newest (checkpoint.resume: {newer[-1]}), set "
            f"checkpoint.on_newer_checkpoints: archive to move {names} into {root / ARCHIVE_DIR}/ first, or use "
            "another checkpoint.checkpoint_dir / output_dir"
        )
    target = _new_archive_dir(root, attempt)
    note = {"archived": [p.name for p in newer], "resumed_from": str(resumed), "attempt": attempt,
            "latest_was": _read_text(root / LATEST_FILE),
            "time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    write_atomic(target / ARCHIVE_NOTE, json.dumps(note, indent=2) + "\n", "archive note")
    # `latest` first: if the moves below are interrupted, the next resume sees the newer steps and refuses again.
    if resumed.resolve().parent == root.resolve():
        atomic_write_text(root / LATEST_FILE, resumed.name + "\n")
    for path in reversed(newer):
        os.replace(path, target / path.name)
    fsync_path(root)
    fsync_path(target)
    return (f"checkpoint.on_newer_checkpoints: archive: moved {names} to {target} (untouched); training goes on from "
            f"{resumed.name}, and latest now names it")


def _new_archive_dir(root: Path, attempt: int) -> Path:
    base = root / ARCHIVE_DIR / f"attempt-{attempt}"
    target, suffix = base, 1
    while target.exists():  # an attempt counter reset (lock file removed) never mixes two archives
        suffix += 1
        target = base.with_name(f"{base.name}-{suffix}")
    target.mkdir(parents=True)
    return target


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def check_saved_step(path: Path, saved_step: object) -> int:
    """The step ``path``'s train state records, checked against its ``step_<N>`` name (a hand-edited or mixed-up
    ``train_state.json`` is refused rather than trusted)."""
    match = _STEP_DIR.match(path.name)
    try:
        step = int(saved_step)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        step = -1
    if step < 0 or (match is not None and int(match.group(1)) != step):
        raise ConfigError(
            f"checkpoint.resume: {path / TRAIN_STATE_FILE} records step {saved_step!r}, but the checkpoint is "
            f"{path.name}; it was edited or mixed up with another checkpoint. Allowed: resume another step_<N> "
            "directory, or put back the file that was saved with it"
        )
    return step
