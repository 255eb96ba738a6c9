"""Out-of-memory notes: how an ``auto`` run re-plans after one of several ranks ran out of memory.

One rank of several cannot retry a step in place after an out-of-memory error: its peers are already waiting in
the step's collectives, which it can no longer match. That rank therefore writes a note into the checkpoint
directory (the step, the error, and the re-planning state in force: the plan, the re-plans so far) and fails.
torchrun (``--max-restarts``; ``remat finetune`` sets it under ``auto``) then restarts every worker, the run
resumes from its newest checkpoint, and before its first step it re-plans from the newest pending note exactly as a
single process would have (`remat.adaptation.retry.StepRetry.replan_after_restart`). Running the same command again
by hand does the same.

A note is *pending* while no checkpoint newer than its step exists: a checkpoint saved after the re-plan carries
the re-planned policy itself (``train_state.json``), so older notes are stale and removed. Applying a pending note
twice (a restart for another reason before the next checkpoint) gives the same plan: the note holds the state the
re-plan starts from. Notes are files ``oom-replan-rank<R>.json``; ``checkpoint.resume: restart`` moves them aside
with the checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from remat.training_state.layout import atomic_write_text
from remat.training_state.names import NOTE_PREFIX

logger = logging.getLogger(__name__)

RESTART_COUNT_ENV: Final[str] = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV: Final[str] = "TORCHELASTIC_MAX_RESTARTS"


@dataclass(frozen=True)
class OutOfMemoryNote:
    """What a rank that ran out of memory before its update leaves for the restarted run.

    ``step``: the step that failed (1 = the first); ``rank``; ``error``: the error's first line; ``first_update``:
    the optimizer had no state yet; ``replans``: the run's re-plans before this one; ``budget_bytes``: the budget
    the run was held to; ``planner`` and ``relax``: the replanner's and the relax watch's state when it failed
    (`remat.adaptation.retry.StepRetry.state_dict`); ``generation``: torchrun's restart count of the failed worker.
    """

    step: int
    rank: int
    error: str
    first_update: bool
    replans: int
    budget_bytes: int
    planner: dict[str, Any] = field(default_factory=dict)
    relax: dict[str, Any] = field(default_factory=dict)
    generation: int = 0

    @property
    def order(self) -> tuple[int, int, int]:
        """Newest first when sorted descending: the later generation, the more re-plans, the later step."""
        return (self.generation, self.replans, self.step)


def note_path(directory: Path, rank: int) -> Path:
    return directory / f"{NOTE_PREFIX}{rank}.json"


def restart_generation() -> int:
    """torchrun's restart count of this worker (0: the first generation, or not under torchrun)."""
    return int(os.environ.get(RESTART_COUNT_ENV, "0") or 0)


def restarts_left() -> int | None:
    """How many more times torchrun restarts the workers after a failure; None when not started by torchrun."""
    if MAX_RESTARTS_ENV not in os.environ:
        return None
    return max(0, int(os.environ[MAX_RESTARTS_ENV] or 0) - restart_generation())


def write_note(directory: Path, note: OutOfMemoryNote) -> Path:
    """Write ``note`` atomically into ``directory`` (created if missing); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = note_path(directory, note.rank)
    atomic_write_text(path, json.dumps(asdict(note), indent=1) + "\n")
    return path


def read_notes(directory: Path) -> list[tuple[Path, OutOfMemoryNote]]:
    """Every readable note in ``directory``; an unreadable one is said and skipped (it is never the only record of
    a re-plan: the failed step runs again and writes a new one if it fails again)."""
    found: list[tuple[Path, OutOfMemoryNote]] = []
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob(f"{NOTE_PREFIX}*.json")):
        try:
            data = json.loads(path.read_text())
            found.append((path, OutOfMemoryNote(**data)))
        except (OSError, ValueError, TypeError) as err:
            logger.warning("skipping the out-of-memory note %s: %s", path, err)
    return found


def pending_note(directory: Path, resumed_step: int) -> OutOfMemoryNote | None:
    """The newest note of a step after ``resumed_step`` (the step the run continues from); the stale ones (a
    checkpoint at or after their step carries the re-plan) are removed."""
    pending: list[OutOfMemoryNote] = []
    for path, note in read_notes(directory):
        if note.step > resumed_step:
            pending.append(note)
        else:
            path.unlink(missing_ok=True)
    return max(pending, key=lambda note: note.order) if pending else None


def clear_notes(directory: Path) -> None:
    """Remove every note (the run finished: nothing is left to re-plan)."""
    if directory.is_dir():
        for path in directory.glob(f"{NOTE_PREFIX}*.json"):
            path.unlink(missing_ok=True)
