"""One writer per directory: a run holds ``<dir>/.remat.lock`` (``fcntl.flock``) on its ``output_dir`` and its
``checkpoint_dir`` from setup to the end of ``run``.

The operating system releases a ``flock`` when its holder dies (kill -9 included), so a lock never outlives its
process. The file also holds a JSON body naming the holder (pid, host, start time, command line) and the run's
attempt number (1 for the first run in this ``output_dir``, then counting up); a second run is refused with one line
that quotes it. A body that was never marked released, whose lock is free, was left by a run that died: the next run
says so in one line and takes it. The file itself is kept (removing a lock file races with its next holder).

Under torchrun only rank 0 takes the locks; its outcome (the refusal, or the attempt number) is broadcast so every
rank stops with the same message or goes on together. On a filesystem without ``flock`` the run goes on with a
warning and no lock.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, TypeVar

import torch.distributed as dist

from remat._files import open_append
from remat.errors import ConfigError
from remat.recipes.config import RecipeConfig
from remat.recipes.run_safety.output_paths import LOCK_FILE

try:
    import fcntl
except ImportError:  # not a POSIX system: no locks, see `_lock_unsupported`
    fcntl = None  # type: ignore[assignment]

_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}
_COMMAND_CHARS = 300

T = TypeVar("T")


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or last held) a directory's lock, as its lock file says."""

    pid: int | None
    host: str
    started: str
    command: str
    attempt: int = 0
    released: bool = False

    @classmethod
    def from_text(cls, text: str) -> LockHolder | None:
        try:
            body = json.loads(text)
            return cls(pid=int(body["pid"]), host=str(body.get("host", "?")), started=str(body.get("started", "?")),
                       command=str(body.get("command", "?")), attempt=int(body.get("attempt", 0)),
                       released=bool(body.get("released", False)))
        except (ValueError, KeyError, TypeError):
            return None

    def to_text(self) -> str:
        return json.dumps({"pid": self.pid, "host": self.host, "started": self.started, "command": self.command,
                           "attempt": self.attempt, "released": self.released}) + "\n"

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {self.started}: {self.command}"

    def is_dead(self) -> bool:
        """Whether the holder is known not to run any more (only knowable on this host)."""
        if self.pid is None or self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


@dataclass
class RunLocks:
    """The locks a run holds, its attempt number, and ``notes``: lines for the run to print (a dead run's lock taken
    over, no lock possible). ``release`` marks the locks released and lets them go (idempotent)."""

    attempt: int = 1
    notes: list[str] = field(default_factory=list)
    _held: list[tuple[IO[str], LockHolder]] = field(default_factory=list)
    _before: dict[int, tuple[Path, str | None, tuple[int, int]]] = field(default_factory=dict)

    def abandon(self) -> None:
        """Let go as if this run had never started (it was refused during setup, before training): each lock file
        gets back the body and times it had, or is removed if this run created it; the attempt is not counted."""
        while self._held:
            handle, _ = self._held.pop()
            path, text, times = self._before.pop(id(handle), (None, None, (0, 0)))
            with suppress(OSError):
                if path is not None and text is None:
                    path.unlink()
                elif path is not None:
                    handle.seek(0)
                    handle.truncate()
                    handle.write(text)
                    handle.flush()
                    os.utime(path, ns=times)
            handle.close()

    def release(self) -> None:
        while self._held:
            handle, holder = self._held.pop()
            with suppress(OSError):
                _write_body(handle, replace(holder, attempt=self.attempt, released=True))
            handle.close()  # closing the descriptor drops the flock


def acquire_run_locks(directories: dict[str, Path]) -> RunLocks:
    """Lock every directory (``{recipe key: path}``, e.g. ``{"output_dir": ...}``) in this process; ConfigError
    naming the key and the holder when another run holds one (the locks taken so far are let go)."""
    locks = RunLocks()
    me = LockHolder(pid=os.getpid(), host=socket.gethostname(),
                    started=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    command=_command_line())
    seen: set[Path] = set()
    stale: dict[LockHolder, list[str]] = {}
    try:
        for index, (key, directory) in enumerate(directories.items()):
            path = directory.resolve()
            if path in seen:
                continue
            seen.add(path)
            previous = _lock_one(key, path, me, locks)
            if index == 0:  # the first directory (output_dir) counts the attempts
                locks.attempt = (previous.attempt if previous is not None else 0) + 1
            if previous is not None and not previous.released:
                stale.setdefault(previous, []).append(key)
        for previous, keys in stale.items():  # one line per dead run, naming every directory it held
            state = "no longer running" if previous.is_dead() else "its lock was free, so it has ended"
            locks.notes.append(f"{', '.join(keys)}: taking over the lock left by a run that did not end cleanly "
                               f"({previous.describe()}; {state})")
    except BaseException:  # refused: let go of what was taken, leaving every lock file's body as it was
        for handle, _ in locks._held:
            handle.close()
        raise
    try:
        for handle, _ in locks._held:
            _write_body(handle, replace(me, attempt=locks.attempt))
    except BaseException:
        locks.release()
        raise
    return locks


def acquire_on_rank0(directories: dict[str, Path], *, rank: int, distributed: bool) -> RunLocks:
    """`acquire_run_locks` on rank 0; every rank gets rank 0's attempt number or raises its ConfigError."""
    held: list[RunLocks] = []

    def take() -> int:
        held.append(acquire_run_locks(directories))
        return held[0].attempt

    attempt = on_rank0(take, rank=rank, distributed=distributed)
    locks = held[0] if held else RunLocks()
    locks.attempt = attempt
    return locks


def on_rank0(action: Callable[[], T], *, rank: int, distributed: bool) -> T:
    """Run ``action`` on rank 0 only and give its result to every rank. When it fails, rank 0 raises its error and
    the other ranks the same ConfigError (or a RuntimeError naming rank 0's failure), so no rank waits forever."""
    outcome: list[Any] = [None, None, None]  # (ConfigError message, other failure, result)
    failure: Exception | None = None
    if rank == 0:
        try:
            outcome[2] = action()
        except ConfigError as err:
            failure, outcome[0] = err, str(err)
        except Exception as err:
            failure, outcome[1] = err, f"{type(err).__name__}: {err}"
    if distributed:
        dist.broadcast_object_list(outcome, src=0)
    if failure is not None:
        raise failure
    if outcome[0] is not None:
        raise ConfigError(outcome[0])
    if outcome[1] is not None:
        raise RuntimeError(f"rank 0 failed ({outcome[1]}); see its output")
    return outcome[2]  # type: ignore[no-any-return]


def _lock_one(key: str, directory: Path, me: LockHolder, locks: RunLocks) -> LockHolder | None:
    """Take ``directory``'s lock into ``locks``; returns the body the previous holder left (None if none)."""
    if fcntl is None:
        _lock_unsupported(key, directory, "this system has no fcntl.flock", locks)
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    existed = path.exists()
    times = (path.stat().st_atime_ns, path.stat().st_mtime_ns) if existed else (0, 0)
    handle = open_append(path, "run lock", read=True)  # held for the run; never through a planted link
    unsupported = _flock_or_refuse(key, directory, handle)
    if unsupported is not None:
        _lock_unsupported(key, directory, unsupported, locks)
        return None
    locks._held.append((handle, me))
    handle.seek(0)
    text = handle.read()
    locks._before[id(handle)] = (path, text if existed else None, times)
    return LockHolder.from_text(text)


def refuse_if_held(directories: dict[str, Path]) -> None:
    """ConfigError naming the holder when another run holds the lock of one of ``directories``; takes nothing. The
    launcher's early check, before it starts workers (which then take the locks themselves)."""
    if fcntl is None:
        return
    for key, directory in directories.items():
        path = directory.resolve()
        if not (path / LOCK_FILE).is_file():
            continue
        handle = open(path / LOCK_FILE, encoding="utf-8")  # noqa: SIM115 (closed below or by _flock_or_refuse)
        if _flock_or_refuse(key, path, handle) is None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        handle.close()


def run_directories(cfg: RecipeConfig) -> dict[str, Path]:
    """The directories a run of ``cfg`` writes, by recipe key: output_dir, and checkpoint_dir when it saves."""
    output_dir = Path(cfg.output_dir)
    directories = {"output_dir": output_dir}
    if cfg.checkpoint.enabled:
        directories["checkpoint.checkpoint_dir"] = Path(cfg.checkpoint.checkpoint_dir or output_dir / "checkpoints")
    return directories


def _flock_or_refuse(key: str, directory: Path, handle: IO[str]) -> str | None:
    """Take ``handle``'s flock (exclusive, non-blocking): None when taken, the reason when flock does not work
    there (``handle`` closed); ConfigError naming the holder when another process holds it (``handle`` closed)."""
    assert fcntl is not None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder_of_held(handle)
        handle.close()
        who = holder.describe() if holder is not None else "a process that has not written its name yet"
        raise ConfigError(
            f"{key}: {directory} is in use by another run ({who}); wait for it to end or stop it, or give this run "
            f"another {key}"
        ) from None
    except OSError as err:
        handle.close()
        if err.errno in _UNSUPPORTED:
            return f"flock is not supported there ({err.strerror})"
        raise
    return None


def _read_holder_of_held(handle: IO[str]) -> LockHolder | None:
    """The holder's body, waiting briefly for a holder that has just taken the lock to write it."""
    for _ in range(20):
        handle.seek(0)
        holder = LockHolder.from_text(handle.read())
        if holder is not None and not holder.released:
            return holder
        time.sleep(0.05)
    return None


def _command_line() -> str:
    """This process's command line, with the remat CLI shown as ``remat`` however it was started."""
    argv = list(sys.argv) or ["python"]
    program = Path(argv[0])
    if program.name == "remat" or (program.parent.name == "remat" and program.name in ("cli.py", "__main__.py")):
        argv[0] = "remat"
    return shlex.join(argv)[:_COMMAND_CHARS]


def _write_body(handle: IO[str], holder: LockHolder) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(holder.to_text())
    handle.flush()
    with suppress(OSError):
        os.fsync(handle.fileno())


def _lock_unsupported(key: str, directory: Path, why: str, locks: RunLocks) -> None:
    message = (f"{key}: cannot lock {directory} ({why}); going on without a lock, so make sure no other run uses "
               "this directory at the same time")
    locks.notes.append(message)
