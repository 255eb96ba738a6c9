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

from remat.distributed.choices import DEVICE_CHOICES
from remat.distributed.rendezvous import INIT_TIMEOUT_S, join_process_group
from remat._files import printable
from remat.errors import ConfigError

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
        values = {name: _count(env, name) for name in TORCHRUN_VARIABLES if name in env}
        missing = [name for name in TORCHRUN_VARIABLES if name not in values]
        if missing:
            if values.get("WORLD_SIZE", 1) > 1:
                raise ConfigError(
                    f"environment: WORLD_SIZE={values['WORLD_SIZE']} asks for several processes, but "
                    f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set, so no launcher started "
                    "this one; start the workers with torchrun (remat finetune RECIPE --nproc-per-node N), or unset "
                    "WORLD_SIZE to train in one process")
            single = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1}
            wrong = [f"{name}={value}" for name, value in values.items() if value != single[name]]
            if wrong:
                raise ConfigError(
                    f"environment: {', '.join(wrong)} without {', '.join(missing)}: no launcher started this process "
                    "and one process is rank 0 of 1; allowed: all four torchrun variables (start the workers with "
                    "remat finetune RECIPE --nproc-per-node N), or none of them (or RANK=0, LOCAL_RANK=0, "
                    "WORLD_SIZE=1, LOCAL_WORLD_SIZE=1) to train in one process")
            return cls()
        process = cls(rank=values["RANK"], local_rank=values["LOCAL_RANK"], world_size=values["WORLD_SIZE"],
                      local_world_size=values["LOCAL_WORLD_SIZE"], launched=True)
        process._check()
        return process

    def _check(self) -> None:
        """ConfigError naming the variable when the launcher's numbers contradict each other."""
        for name, value, bound in (("WORLD_SIZE", self.world_size, None), ("LOCAL_WORLD_SIZE", self.local_world_size,
                                   self.world_size), ("RANK", self.rank, self.world_size),
                                   ("LOCAL_RANK", self.local_rank, self.local_world_size)):
            low = 1 if name.endswith("SIZE") else 0
            high = bound if name.endswith("SIZE") else (bound - 1 if bound is not None else None)
            if value < low or (high is not None and value > high):
                allowed = f"{low} .. {high}" if high is not None else f"{low} or more"
                raise ConfigError(f"environment: {name}={value} is impossible with WORLD_SIZE={self.world_size} and "
                                  f"LOCAL_WORLD_SIZE={self.local_world_size}; allowed: {allowed} (torchrun sets these: "
                                  "start the workers with remat finetune RECIPE --nproc-per-node N)")


def _count(env: Mapping[str, str], name: str) -> int:
    """The integer in the environment variable `name`; ConfigError naming it when it holds anything else."""
    text = env[name].strip()
    if not (text.isdigit() or (text.startswith("-") and text[1:].isdigit())) or len(text) > 9:
        raise ConfigError(f"environment: {name}={printable(env[name], 40)!r} is not a process count or rank; torchrun "
                          "sets it to an integer: start the workers with remat finetune RECIPE --nproc-per-node N, or "
                          f"unset {name} to train in one process")
    return int(text)


def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a worker started by torchrun (or a launcher that sets the same variables)."""
    env = os.environ if environ is None else environ
    return all(name in env for name in TORCHRUN_VARIABLES)




def resolve_device(choice: str | torch.device | None, env: ProcessEnv) -> torch.device:
    """The device of this worker for ``distributed.device``.

    ``auto`` (or None): CUDA device ``local_rank`` when CUDA is available and the node has at least one GPU per local
    rank; otherwise the CPU, with a warning when GPUs exist but are too few (two ranks on one GPU would make NCCL
    fail). ``cpu``: the CPU, GPUs or not. ``cuda``: CUDA device ``local_rank``; a ConfigError when CUDA is not
    available or the node has fewer GPUs than local ranks. A ``torch.device`` (or a string such as ``"cuda:1"``) is
    used as it is.
    """
    if isinstance(choice, torch.device):
        return choice
    if choice in (None, "auto"):
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus >= env.local_world_size:
            return torch.device("cuda", env.local_rank)
        if gpus:
            logger.warning("distributed.device auto: %d local ranks but %d CUDA device%s; running on the CPU (gloo). "
                           "Start at most %d processes per node to use the GPUs", env.local_world_size, gpus,
                           "" if gpus == 1 else "s", gpus)
        return torch.device("cpu")
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda":
        check_cuda_devices(env.local_world_size)
        return torch.device("cuda", env.local_rank)
    try:
        return torch.device(choice)
    except RuntimeError as err:
        raise ConfigError(f"distributed.device: got {choice!r}; allowed: {', '.join(DEVICE_CHOICES)}") from err


def check_cuda_devices(local_ranks: int) -> None:
    """ConfigError (naming ``distributed.device``) unless CUDA is available with a GPU for each of ``local_ranks``."""
    if not torch.cuda.is_available():
        raise ConfigError("distributed.device: 'cuda' but torch.cuda.is_available() is False; allowed here: auto, "
                          "cpu")
    gpus = torch.cuda.device_count()
    if gpus < local_ranks:
        raise ConfigError(f"distributed.device: 'cuda' with {local_ranks} processes per node, but this node has "
                          f"{gpus} CUDA device{'' if gpus == 1 else 's'}; allowed: at most {gpus} processes per node "
                          "on cuda, or device cpu (gloo)")


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors (with gloo for CPU-side collectives), gloo on the CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_process_group(env: ProcessEnv, device: torch.device, *, init_timeout_s: float = INIT_TIMEOUT_S,
                       timeout_s: float | None = None) -> bool:
    """Join the process group described by ``env`` (torchrun's variables), or start a one-process group outside
    torchrun. Joining must finish within ``init_timeout_s`` (a `DistributedSetupError` otherwise); collectives then
    time out after ``timeout_s`` (None: torch's default). See `remat.distributed.rendezvous`.

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
        join_process_group(backend, rank=env.rank, world_size=env.world_size,
                           device_id=device if device.type == "cuda" else None, init_timeout_s=init_timeout_s,
                           timeout_s=timeout_s)
    else:
        # A one-process group needs no rendezvous: an in-memory store is enough.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    logger.info("process group: rank %d of %d, backend %s, device %s", env.rank, env.world_size, backend, device)
    return True
