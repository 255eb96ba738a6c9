"""One call in a child interpreter that has joined no process group: the one way remat leaves its process to
estimate or plan (`call_in_child`), under one rule (`needs_fresh_process`).

# NOTE [ A fresh interpreter for the fake process group ]
# The estimate simulates FSDP2 and context parallelism in a fake process group of ``world_size`` ranks
# (`remat.estimate.simulate`), and a process has one default process group. A torchrun worker or a Trainer under
# accelerate has joined a real one by the time it asks for an estimate, a plan or a re-plan, so the same call is
# made in a child: ``python -P -m remat._child``, with this process's import path but not its working directory
# (``-P``, `SAFE_PYTHON_FLAGS`), and without the launch variables (``RANK``, ``MASTER_ADDR``, ...) so that it joins
# nothing. The child answers the same thing this process would have: the estimate is a pure function of the
# model's config and the step's settings (no weights, no device memory; a CUDA target is modelled, not queried,
# once the budget is in bytes). Each rank that asks starts its own child, and ranks that ask the same question get
# the same answer, so no collective is needed (and none can hang when only one rank asks). Any other step (single
# process, DDP without context parallelism) is simulated in this process, joined or not.
#
# Arguments and the answer cross as pickles through the child's stdin and stdout: both ends are this library's
# code, in a child this process started, over pipes no one else holds; nothing is read from a file. The child runs
# only functions of remat marked `child_call` (the mark is checked on both sides), so this low module names none
# of them. Its own stdout is sent to its stderr while it works, so a print or a log line cannot corrupt the answer.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from typing import Any, Final, TypeVar

from remat.errors import ConfigError

logger = logging.getLogger(__name__)

#: Interpreter flags of every Python process remat starts: no working directory on the import path (``-P``, Python
#: 3.11+), unbuffered output (what torchrun gives its workers).
SAFE_PYTHON_FLAGS: Final[tuple[str, ...]] = ("-P", "-u")

#: What torchrun (and accelerate) set for a worker to join its process group; a child must not see them.
LAUNCH_VARIABLES: Final[tuple[str, ...]] = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                            "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_MARK: Final[str] = "__remat_child_call__"
_Function = TypeVar("_Function", bound=Callable[..., Any])


def child_call(function: _Function) -> _Function:
    """Mark ``function`` (a module-level function of remat) as one a child may run for `call_in_child`."""
    setattr(function, _MARK, True)
    return function


def needs_fresh_process(strategy: str, cp_size: int) -> bool:
    """The rule: simulating a step with ``strategy`` and ``cp_size`` needs a fake process group (FSDP2, context
    parallelism) and this process has joined a real one."""
    import torch.distributed as dist

    return (strategy == "fsdp2" or cp_size > 1) and dist.is_available() and dist.is_initialized()


def child_environment() -> dict[str, str]:
    """This process's environment for a child that joins no process group: the launch variables and torchelastic's
    removed, ``PYTHONPATH`` set to this process's import path (the child finds what this process imported)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def call_in_child(function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` (marked `child_call`) in a child interpreter (NOTE above): its answer; its
    `ConfigError` raised again here with the same message; `RuntimeError` with its output when it fails otherwise."""
    target = _target(function)
    logger.info("%s runs in a child process: this process joined a process group, and the estimate simulates one "
                "of its own", function.__name__)
    proc = subprocess.run([sys.executable, *SAFE_PYTHON_FLAGS, "-m", __name__],
                          input=pickle.dumps((target, args, kwargs)), capture_output=True, env=child_environment(),
                          check=False)
    if proc.returncode != 0 or not proc.stdout:
        stderr = proc.stderr.decode(errors="replace")[-4000:]
        raise RuntimeError(f"{target} in a child process failed (exit {proc.returncode}):\n{stderr}")
    kind, value = pickle.loads(proc.stdout)  # noqa: S301 (this library's own child, over its own pipe: NOTE above)
    if kind == "config_error":
        raise ConfigError(value)
    return value


def _target(function: Callable[..., Any]) -> str:
    module, name = getattr(function, "__module__", ""), getattr(function, "__qualname__", "")
    if not (module.startswith("remat.") and getattr(function, _MARK, False)):
        raise ValueError(f"call_in_child: {module}:{name} is not a function of remat marked child_call")
    return f"{module}:{name}"


def _child_main() -> None:
    """The child of `call_in_child`: one pickled call on stdin, one pickled answer on stdout."""
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything the call prints goes to stderr, not into the answer
    target, args, kwargs = pickle.loads(sys.stdin.buffer.read())  # noqa: S301 (from the parent: NOTE above)
    module, _, name = str(target).partition(":")
    function = getattr(importlib.import_module(module), name, None) if module.startswith("remat.") else None
    if function is None or not getattr(function, _MARK, False):
        raise SystemExit(f"remat._child: {target!r} is not a function of remat marked child_call")
    try:
        result: tuple[str, Any] = ("ok", function(*args, **kwargs))
    except ConfigError as err:
        result = ("config_error", str(err))
    answer.write(pickle.dumps(result))
    answer.close()


if __name__ == "__main__":
    _child_main()
