"""Estimates and plans from inside a distributed job: the call runs again in a child interpreter that has joined no
process group (`call_in_child`), when the step needs a fake one of its own (`needs_fresh_process`).

# NOTE [ A fresh interpreter for the fake process group ]
# The estimate simulates FSDP2 and context parallelism in a fake process group of ``world_size`` ranks
# (`remat.estimate.simulate`), and a process has one default process group. A torchrun worker or a Trainer under
# accelerate has joined a real one by the time it asks for a plan, so the same call is made in a child: ``python
# -P -m remat.estimate.isolation``, with this process's import path but not its working directory (``-P``,
# `remat.distributed.launch.SAFE_PYTHON_FLAGS`), and without the launch variables (``RANK``, ``MASTER_ADDR``, ...)
# so that it joins nothing. The child answers the same thing this process would have: the estimate is a pure
# function of the model's config and the step's settings (no weights, no device memory; a CUDA target is modelled,
# not queried, once the budget is in bytes). Each rank that asks starts its own child, and ranks that ask the same
# question get the same answer, so no collective is needed (and none can hang when only one rank asks).
#
# Arguments and the answer cross as pickles through the child's stdin and stdout: both ends are this library's
# code, in a child this process started, over pipes no one else holds; nothing is read from a file. The child runs
# only the functions in `CHILD_CALLS`. Its own stdout is sent to its stderr while it works, so a print or a log line
# cannot corrupt the answer.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import subprocess
import sys
from typing import Any, Final

import torch.distributed as dist

from remat.distributed.launch import SAFE_PYTHON_FLAGS
from remat.errors import ConfigError

logger = logging.getLogger(__name__)

#: The functions a child runs, as ``module:name``: the estimate and the planner's two entry points.
CHILD_CALLS: Final[frozenset[str]] = frozenset({
    "remat.estimate.api:estimate_memory",
    "remat.planner.api:plan_model_step",
    "remat.planner.api:plan_recipe",
})

#: What torchrun (and accelerate) set for a worker to join its process group; a child must not see them.
LAUNCH_VARIABLES: Final[tuple[str, ...]] = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                            "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def needs_fresh_process(strategy: str, cp_size: int) -> bool:
    """True when simulating a step with ``strategy`` and ``cp_size`` needs a fake process group (FSDP2, context
    parallelism) and this process has joined a real one."""
    return (strategy == "fsdp2" or cp_size > 1) and dist.is_available() and dist.is_initialized()


def child_environment() -> dict[str, str]:
    """This process's environment for a child that joins no process group: the launch variables and torchelastic's
    removed, ``PYTHONPATH`` set to this process's import path (the child finds what this process imported)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def call_in_child(target: str, /, *args: Any, **kwargs: Any) -> Any:
    """``target(*args, **kwargs)`` (one of `CHILD_CALLS`) in a child interpreter (NOTE above): its answer; its
    `ConfigError` raised again here with the same message; `RuntimeError` with its output when it fails otherwise."""
    if target not in CHILD_CALLS:
        raise ValueError(f"call_in_child: {target!r} is not one of {sorted(CHILD_CALLS)}")
    logger.info("%s runs in a child process: this process joined a process group, and the estimate simulates one "
                "of its own", target.rpartition(":")[2])
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


def _child_main() -> None:
    """The child of `call_in_child`: one pickled call on stdin, one pickled answer on stdout."""
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything the call prints goes to stderr, not into the answer
    target, args, kwargs = pickle.loads(sys.stdin.buffer.read())  # noqa: S301 (from the parent: NOTE above)
    if target not in CHILD_CALLS:
        raise SystemExit(f"remat.estimate.isolation: {target!r} is not one of {sorted(CHILD_CALLS)}")
    module, _, name = target.partition(":")
    function = getattr(importlib.import_module(module), name)
    try:
        result: tuple[str, Any] = ("ok", function(*args, **kwargs))
    except ConfigError as err:
        result = ("config_error", str(err))
    answer.write(pickle.dumps(result))
    answer.close()


if __name__ == "__main__":
    _child_main()
