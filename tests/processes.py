"""Child processes of the tests that cannot outlive them.

torchrun starts its workers in sessions of their own, so ending a launcher (``remat finetune --nproc-per-node``,
``python -m torch.distributed.run``) or its process group leaves the workers running: on CI they would wait in a gloo
collective for torch's 30 minutes, or forever. `run_bounded` is ``subprocess.run(capture_output=True, text=True)``
whose time limit ends the whole tree (found through ``/proc``), and `marked_processes` finds what a test left
behind (``tests/conftest.py`` checks that after every test).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

PROC = Path("/proc")
#: Environment variable set to a new value for every test; each process the test starts inherits it.
TEST_MARK = "REMAT_TEST_MARK"
#: Helpers that the test process starts once and keeps for the rest of the session (``mp.spawn`` starts the
#: resource tracker): they carry the mark of the test that first needed them, but are not that test's leftovers.
SESSION_HELPERS = ("from multiprocessing.resource_tracker import main", "from multiprocessing.forkserver import main")


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), read from ``/proc/<pid>/task/*/children`` (Linux; an empty
    list elsewhere)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        for task in (PROC / str(parent) / "task").glob("*"):
            with contextlib.suppress(OSError):
                for child in map(int, (task / "children").read_text().split()):
                    if child not in found:
                        found.append(child)
                        pending.append(child)
    return found


def end_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and all its descendants (collected before the first kill, so that none is re-parented out of
    reach); returns the pids that were signalled."""
    tree = [pid, *descendants(pid)]
    for member in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)
    return tree


def run_bounded(command: Sequence[str], *, timeout: float, cwd: Path | str | None = None,
                env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to its end and capture its output as text; after ``timeout`` seconds end it with every process
    it started and fail (AssertionError) with the end of what it printed."""
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env=None if env is None else dict(env), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as caught:  # the time limit, or the test being interrupted: nothing may outlive it
        ended = end_tree(proc.pid)
        out, err = proc.communicate()
        if not isinstance(caught, subprocess.TimeoutExpired):
            raise
        raise AssertionError(f"{' '.join(command)} still ran after {timeout:g} s; ended it and {len(ended) - 1} "
                             f"process(es) it started. Its output:\n{out[-4000:]}\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def marked_processes(value: str) -> dict[int, str]:
    """pid -> command line of every process (but this one and the `SESSION_HELPERS`) whose environment has
    ``TEST_MARK=value``."""
    wanted = f"{TEST_MARK}={value}".encode()
    found: dict[int, str] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if wanted not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if not any(helper in command for helper in SESSION_HELPERS):
            found[int(entry.name)] = command
    return found


def reap_leftovers(value: str, grace_s: float = 10.0) -> dict[int, str]:
    """Processes still marked with ``value`` after ``grace_s`` seconds (those exiting by themselves get that long),
    SIGKILLed with their descendants; returns them (pid -> command line)."""
    deadline = time.monotonic() + grace_s
    left = marked_processes(value)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = marked_processes(value)
    for pid in left:
        end_tree(pid)
    return left


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail the block (AssertionError) if it runs longer than ``seconds``: for code that must never block, such as
    reading a FIFO planted where a file was expected (SIGALRM interrupts a blocking open or read). Main thread only."""

    def expired(signum: int, frame: object) -> None:
        raise AssertionError(f"still running after {seconds:g} s: it blocked")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
