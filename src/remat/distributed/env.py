"""The process environment torchrun gives each worker, and the process group built from it.

torchrun (``torch.distributed.run``) sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` in every worker; ``torch.distributed.init_process_group`` reads the rendezvous
from them (``env://``). A process started without torchrun is rank 0 of 1.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: Variables torchrun sets in each worker; all of them present means "running under torchrun".
TORCHRUN_VARIABLES: tuple[str, ...] = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class ProcessEnv:
    """This process's place among the workers: global rank, rank on its node, and the counts of both."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launched: bool = False
    """True when the variables come from a launcher (torchrun), False for a plain single process."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ProcessEnv:
        """Read the torchrun variables; a process without them is rank 0 of 1."""
        env = os.environ if environ is None else environ
        if not under_torchrun(env):
            return cls()
        values = {}
        for name in TORCHRUN_VARIABLES:
            try:
                values[name] = int(env[name])
            except ValueError as err:
                raise RuntimeError(f"environment variable {name}={env[name]!r} is not an integer") from err
        return cls(rank=values["RANK"], local_rank=values["LOCAL_RANK"], world_size=values["WORLD_SIZE"],
                   local_world_size=values["LOCAL_WORLD_SIZE"], launched=True)


def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a worker started by torchrun (or a launcher that sets the same variables)."""
    env = os.environ if environ is None else environ
    return all(name in env for name in TORCHRUN_VARIABLES)


def default_device(local_rank: int) -> torch.device:
    """The device of a worker: CUDA device ``local_rank`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors (with gloo for CPU-side collectives), gloo on the CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_process_group(env: ProcessEnv, device: torch.device) -> bool:
    """Join the process group described by ``env`` (``env://``), or start a one-process group outside torchrun.

    Returns False when a process group already exists (it is reused as it is), True when this call created it.
    """
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size:
            raise RuntimeError(f"a process group of {dist.get_world_size()} ranks already exists, but the "
                               f"environment says WORLD_SIZE={env.world_size}")
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = backend_for(device)
    if env.launched:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        # A one-process group needs no rendezvous: an in-memory store is enough.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    logger.info("process group: rank %d of %d, backend %s, device %s", env.rank, env.world_size, backend, device)
    return True
