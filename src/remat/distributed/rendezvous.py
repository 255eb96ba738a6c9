"""Joining the process group of a torchrun launch: a key space of its own for every restart, and a time limit.

Why a key space per restart. torchrun's c10d rendezvous (``--standalone`` included) and its static rendezvous keep one
TCPStore in the agent for the whole job and hand it to every generation of workers
(``TORCHELASTIC_USE_AGENT_STORE=True``). ``init_process_group`` writes its keys there under fixed names (gloo: each
rank's listening address), so after a restart a rank can read the address its peer had in the previous generation:
gloo's ``connectFullMesh`` then fails with "Connection refused", or waits on a socket nobody will answer (measured:
5 of 11 restarts failed, 2 hung; pytorch/pytorch#135712). On one node every worker of a generation has the same
``TORCHELASTIC_RESTART_COUNT``, so `join_process_group` puts each generation's keys under their own prefix. Over
several nodes the counts can differ between nodes; there remat's launcher sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
so that each rendezvous round gets a new store (see `remat.distributed.launch`).

Why a time limit. A rank that never arrives (a node not started, a wrong ``--node-rank``, a stale address) used to
leave the others waiting for torch's default 30 minutes or more. The setup now has its own limit (``init_timeout_s``,
10 minutes by default): torch's own wait ends with a `DistributedSetupError` naming the ranks and the address, and a
watchdog ends the process with the same message should a native wait outlast it. Collectives keep their own limit
(``timeout_s``; torch's default when None: 30 minutes for gloo, 10 for NCCL).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from remat.errors import DistributedSetupError

logger = logging.getLogger(__name__)

#: Default limit of the process-group setup (rendezvous, connecting every pair of ranks, the device mesh).
INIT_TIMEOUT_S = 600.0
#: Exit status of a process the setup watchdog ends (the command line's status for user-fixable errors).
WATCHDOG_EXIT_CODE = 2
#: The watchdog fires this long after the setup limit, so that torch's own timeout (a clean error) comes first.
WATCHDOG_GRACE_S = 15.0


def restart_store(environ: Mapping[str, str] | None = None, *,
                  timeout: timedelta = timedelta(seconds=INIT_TIMEOUT_S)) -> dist.Store | None:
    """The store this generation of workers joins through: torchrun's shared agent store, under the prefix
    ``remat/restart_<TORCHELASTIC_RESTART_COUNT>/``, when all ranks run on one node (their restart counts then
    agree); None otherwise (``env://`` as torch does it)."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    if env.get("WORLD_SIZE") != env.get("LOCAL_WORLD_SIZE"):
        if restart != "0":
            logger.warning("restart %s over several nodes reuses torchrun's shared store, where keys of the previous "
                           "attempt can make the setup fail or hang; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for "
                           "every torchrun of the job (remat's launcher does)", restart)
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"remat/restart_{restart}", store)


def join_process_group(backend: str, *, rank: int, world_size: int, device_id: torch.device | None,
                       init_timeout_s: float = INIT_TIMEOUT_S, timeout_s: float | None = None) -> None:
    """``init_process_group`` from torchrun's environment within ``init_timeout_s`` (a `DistributedSetupError`
    otherwise), then the collectives' limit set to ``timeout_s`` (None: torch's default for the backend)."""
    init_timeout = timedelta(seconds=init_timeout_s)
    try:
        store = restart_store(timeout=init_timeout)
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=init_timeout,
                                    device_id=device_id)
        else:
            dist.init_process_group(backend, timeout=init_timeout, device_id=device_id)
    except RuntimeError as err:  # DistStoreError, gloo's connectFullMesh, NCCL's init: all RuntimeErrors
        raise DistributedSetupError(setup_failure(rank, world_size, init_timeout_s, str(err))) from err
    collective = timedelta(seconds=timeout_s) if timeout_s is not None else _torch_default_timeout(backend)
    set_timeout = getattr(dist, "set_timeout", None)  # public from torch 2.15, which deprecates the private one
    if set_timeout is not None:
        set_timeout(collective)
    else:
        dist.distributed_c10d._set_pg_timeout(collective)


def setup_failure(rank: int, world_size: int, init_timeout_s: float, cause: str) -> str:
    """The one-line message of a setup that did not complete."""
    env = os.environ
    where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
    restart = env.get("TORCHELASTIC_RESTART_COUNT")
    first = cause.strip().splitlines()[0].rstrip(".") if cause.strip() else "no answer"
    return (f"distributed setup: rank {rank} of {world_size} could not join the process group at {where}"
            + (f" (restart {restart})" if restart not in (None, "0") else "")
            + f" within distributed.init_timeout_s={init_timeout_s:g}: {first[:300]}. A rank did not arrive or "
            "cannot be reached: check that every node was started with the same --nnodes and its own --node-rank "
            "(0 .. nnodes-1), and that the address is reachable; raise distributed.init_timeout_s for slow starts")


@contextlib.contextmanager
def setup_deadline(seconds: float, describe: str) -> Iterator[None]:
    """End the process (status `WATCHDOG_EXIT_CODE`, ``error: <describe>`` on stderr) if the block is still running
    ``seconds`` after it started: a native wait inside torch cannot be interrupted from Python."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            print(f"error: {describe}", file=sys.stderr, flush=True)
            os._exit(WATCHDOG_EXIT_CODE)

    watchdog = threading.Thread(target=watch, name="remat-setup-watchdog", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        done.set()


def _torch_default_timeout(backend: str) -> timedelta:
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

    if "nccl" in backend and default_pg_nccl_timeout is not None:
        return default_pg_nccl_timeout
    return default_pg_timeout
