"""Verified resume: check a checkpoint's contents against its ``COMPLETE.json`` hashes, fall back to the newest one
that verifies and loads, stop with one line when none does, and move checkpoints aside for an explicit restart.

Order of trial (`resume_candidates`): the checkpoint ``latest`` names, then every other ``step_<N>`` directory, newest
step first; but complete checkpoints of higher steps finished after ``latest`` was written (a save killed between
publishing its step and moving ``latest``) come before it. Each is first verified (every file's size and SHA-256, by
rank 0 only, the verdict broadcast), and only a checkpoint that verifies is loaded into the model, optimizer,
scheduler and RNGs; a load that still fails (on any rank: the ranks exchange their outcome) moves every rank on to
the next one, whose load overwrites all of that state again. Each skipped checkpoint is logged once with its reason.
A `ConfigError` from a load (the recipe does not fit the checkpoint: peft or not, shapes, strategy) is not a broken
checkpoint: it stops at once, since every older one would fail the same way. Nothing here deletes or rewrites a
checkpoint: once a fallback has loaded, the skipped ones are moved, intact, into ``<root>/.broken-<UTC time>/`` and
``latest`` is pointed at the one loaded, so that the resumed run's saves of the same step numbers never replace them
and pruning never counts them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from remat.errors import ConfigError
from remat.training_state.digest import HASH_ALGORITHM, digests
from remat.training_state.layout import (
    COMPLETE_MARKER,
    LATEST_FILE,
    LAYOUT_SHARDED,
    _step_of,
    atomic_write_text,
    incomplete_reason,
    is_step_name,
    marker_records,
    read_marker,
    read_pointer,
    step_directories,
)
from remat.training_state.data_only import DCP_DIR, metadata_problem
from remat.training_state.names import NOTE_PREFIX

logger = logging.getLogger(__name__)

T = TypeVar("T")

SUPERSEDED_PREFIX = ".superseded-"
BROKEN_PREFIX = ".broken-"
#: What ``checkpoint.resume: restart`` moves aside: step directories, the pointer and leftovers of interrupted saves.
_MOVED_PREFIXES = (".tmp-step_", f".{LATEST_FILE}.tmp-", NOTE_PREFIX)
_MAX_REASON_CHARS = 240


def verify_checkpoint(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted (marker, a file's size or its SHA-256), or None when it
    verifies. Format-1 markers (sizes only) pass with a warning that their contents are unverified."""
    reason = incomplete_reason(path)
    if reason is not None:
        return reason
    marker = read_marker(path)
    records = marker_records(marker) if marker is not None else None
    assert records  # incomplete_reason checked both
    if marker is not None and marker.get("format") == 1:
        if marker.get("layout") == LAYOUT_SHARDED and (problem := metadata_problem(path / DCP_DIR)) is not None:
            return problem
        logger.warning("%s: written before content hashes (%s format 1): sizes checked, contents unverified",
                       path, COMPLETE_MARKER)
        return None
    names = sorted(records)
    for rel, actual in zip(names, digests([path / rel for rel in names]), strict=True):
        expected = records[rel][1]
        if actual != expected:
            return (f"{rel}: content differs from {COMPLETE_MARKER} ({HASH_ALGORITHM} {actual[:12]}... vs "
                    f"{str(expected)[:12]}...)")
    if marker is not None and marker.get("layout") == LAYOUT_SHARDED:
        return metadata_problem(path / DCP_DIR)  # a planted step's hashes match: what it holds is checked too
    return None


def raise_if_unverified(path: Path, *, agreed: bool = False) -> None:
    """ConfigError naming the checkpoint and the reason when `path` does not verify (`agreed`: rank 0 verifies for
    all ranks, see `agreed_verification`)."""
    reason = agreed_verification(path) if agreed else verify_checkpoint(path)
    if reason is not None:
        raise ConfigError(f"checkpoint {path} fails verification: {reason}; load an earlier checkpoint")


def agreed_verification(path: Path) -> str | None:
    """`verify_checkpoint` computed by rank 0 and broadcast, so that every rank takes the same decision (a
    collective when a process group exists; the directory must be on a file system every rank sees)."""
    return _from_rank_0(verify_checkpoint(path) if _rank() == 0 else None)


def resume_candidates(root: Path) -> tuple[list[Path], str | None]:
    """The ``step_<N>`` directories under `root` in the order resume tries them (the one ``latest`` names first, then
    newest step first), and what is wrong with ``latest`` (None if it is absent or names one of them)."""
    ordered = list(reversed(step_directories(root)))
    pointer = root / LATEST_FILE
    if not pointer.is_file() and not pointer.is_symlink():
        return ordered, None
    try:
        name = read_pointer(root)
    except (ConfigError, OSError, ValueError) as err:
        return ordered, f"{pointer} is unreadable ({type(err).__name__})"
    if not is_step_name(name):
        return ordered, f"{pointer} holds {name[:40]!r}, not a step_<N> name"
    if root / name not in ordered:
        return ordered, f"{pointer} names {name}, which does not exist"
    ordered.remove(root / name)
    newer = [p for p in ordered if _step_of(p) > _step_of(root / name) and _finished_after(p, pointer)]
    if newer:  # a save published them but was stopped (kill -9) before it moved `latest`: they come first
        rest = [p for p in ordered if p not in newer]
        return [*newer, root / name, *rest], (f"{pointer} names {name}, but {newer[0].name} was completed after "
                                              "it was written (a save stopped before moving it)")
    return [root / name, *ordered], None


def _finished_after(checkpoint: Path, pointer: Path) -> bool:
    """Whether `checkpoint`'s marker was written after `pointer` (a save writes the marker, publishes, then moves
    ``latest``; a step saved before ``latest`` was moved elsewhere is older than the pointer and does not count)."""
    try:
        return (checkpoint / COMPLETE_MARKER).stat().st_mtime_ns > pointer.stat().st_mtime_ns
    except OSError:
        return False


def load_newest_verified(root: Path, load: Callable[[Path], T]) -> tuple[Path, T] | None:
    """Load (with `load`, on every rank) the first checkpoint under `root` that verifies and loads, in the order of
    `resume_candidates`; None when `root` holds no checkpoint. ConfigError, naming each checkpoint and its reason and
    the way to start over, when checkpoints exist and none verifies and loads."""
    candidates, pointer_problem = _from_rank_0(resume_candidates(root) if _rank() == 0 else None)
    if pointer_problem is not None:
        _say("%s; trying the newest checkpoint that verifies", pointer_problem)
    skipped: list[str] = []
    for index, path in enumerate(candidates):
        reason = agreed_verification(path)
        if reason is None:
            loaded, reason = _agreed_load(path, load)
            if reason is None:
                if skipped:
                    _keep_skipped_aside(root, candidates[:index], path)
                return path, loaded  # type: ignore[return-value]
        _say("skipping checkpoint %s: %s; trying the next newest", path, reason)
        skipped.append(f"{path.name} ({reason})")
    if not skipped and pointer_problem is None:
        return None
    found = "; ".join(skipped) if skipped else "no step_<N> directory"
    raise ConfigError(
        f"checkpoint.resume: no checkpoint in {root} verifies and loads: {found}"
        + (f"; {pointer_problem}" if pointer_problem is not None else "")
        + "; nothing was deleted. To start over, run with --restart (checkpoint.resume: restart moves them into "
        f"{root}/{SUPERSEDED_PREFIX}<time>/) or use a new output_dir"
    )


def load_verified(path: Path, load: Callable[[Path], T]) -> T:
    """Verify the checkpoint at `path` (every rank agreeing) and load it with `load`; ConfigError naming
    ``checkpoint.resume`` and the reason when it does not verify or load (no fallback: the user named this one)."""
    reason = agreed_verification(path)
    if reason is None:
        loaded, reason = _agreed_load(path, load)
        if reason is None:
            return loaded  # type: ignore[return-value]
    raise ConfigError(f"checkpoint.resume: {path} cannot be resumed: {reason}; nothing was changed. Allowed: another "
                      "step_<N> directory, auto (the newest checkpoint that verifies), or restart")


def supersede_checkpoints(root: Path) -> Path | None:
    """Move the checkpoints under `root` (step directories, ``latest``, leftovers of interrupted saves) into
    ``root/.superseded-<UTC time>/`` on rank 0, nothing deleted; returns that directory (None if there was nothing
    to move). ConfigError naming `root` on every rank when they cannot be moved."""
    moved, error = None, None
    if _rank() == 0:
        try:
            moved = _move_aside(root)
        except OSError as err:
            error = (f"checkpoint.resume: restart cannot move the checkpoints in {root} aside: {_one_line(err)}; "
                     "nothing was deleted. Allowed: fix the permissions, or use a new output_dir")
    moved, error = _from_rank_0((moved, error))
    if error is not None:
        raise ConfigError(error)
    if moved is not None:
        _say("checkpoint.resume: restart: moved the earlier checkpoints of %s into %s; starting at step 0", root, moved)
    return moved


def _keep_skipped_aside(root: Path, skipped: list[Path], loaded: Path) -> None:
    """On rank 0, move the checkpoints skipped before `loaded` into ``root/.broken-<time>/`` and point ``latest`` at
    `loaded`; a failure to move is said and leaves them in place (the resume itself has succeeded)."""
    if _rank() != 0:
        return
    try:
        moved = _move_aside(root, skipped, BROKEN_PREFIX)
        atomic_write_text(root / LATEST_FILE, loaded.name + "\n")
    except OSError as err:
        logger.warning("could not move the skipped checkpoints of %s aside (%s); they stay in place, and saves of "
                       "the same step numbers will replace them", root, _one_line(err))
        return
    logger.warning("kept the skipped checkpoints %s, unchanged, in %s; %s now names %s",
                   ", ".join(p.name for p in skipped), moved, LATEST_FILE, loaded.name)


def _move_aside(root: Path, entries: list[Path] | None = None, prefix: str = SUPERSEDED_PREFIX) -> Path | None:
    """Move `entries` (by default every checkpoint entry of `root`) into a new ``root/<prefix><UTC time>/``."""
    if not root.is_dir():
        return None
    if entries is None:
        entries = sorted(p for p in root.iterdir()
                         if (is_step_name(p.name) and p.is_dir()) or p.name == LATEST_FILE
                         or p.name.startswith(_MOVED_PREFIXES))
    if not entries:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = root / f"{prefix}{stamp}"
    suffix = 1
    while True:
        try:
            target.mkdir()
            break
        except FileExistsError:
            suffix += 1
            target = root / f"{prefix}{stamp}-{suffix}"
    try:
        for entry in entries:
            os.replace(entry, target / entry.name)
    except OSError:
        if not any(target.iterdir()):
            target.rmdir()
        raise
    return target


def _agreed_load(path: Path, load: Callable[[Path], T]) -> tuple[T | None, str | None]:
    """Run `load` on every rank; (its result, None) if it succeeded everywhere, else (None, the first failure).
    A ConfigError on any rank is raised on every rank."""
    result: T | None = None
    failure: tuple[str, str] | None = None
    try:
        result = load(path)
    except ConfigError as err:
        failure = ("config", str(err))
    except Exception as err:  # noqa: BLE001 (any load error of a damaged checkpoint moves on to the next one)
        failure = ("load", f"loading failed with {type(err).__name__}: {_one_line(err)}")
    failures = [f for f in _gather(failure) if f is not None]
    for kind, message in failures:
        if kind == "config":
            raise ConfigError(message)
    return (result, None) if not failures else (None, failures[0][1])


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."


def _say(message: str, *args: Any) -> None:
    """A warning logged once, by rank 0 (every rank takes the same decision)."""
    if _rank() == 0:
        logger.warning(message, *args)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _from_rank_0(value: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: Any) -> list[Any]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
