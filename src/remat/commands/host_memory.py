"""Before an offloading recipe trains: does this node have the host memory its offloaded activations need?

The bytes come from the estimate (`remat.estimate.estimate_memory`, ``host_peak_bytes``): the recipe's own step on
fake tensors, through the same offload hooks, so every policy (``offload: true`` of the kept block inputs, mode
``offload`` of everything a block saves) and every model is counted as it will run, in seconds and without
allocating. Per node the need is that figure times the ranks on the node (every rank holds its own host copies);
it is compared with the host memory available now (`remat.memory.host.available_host_bytes`; pinned buffers come out
of it too). Too little is one `ConfigError` line before anything is built; enough is one log line saying how much
the run will hold. On the CPU the offload copies nothing (the tensors already live in host memory): nothing to
check.

``remat finetune --nproc-per-node N`` checks once per node, in the launcher, and tells its workers so
(`CHECKED_ENV`); a worker started by another launcher checks for its node itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any, Final

from remat.errors import ConfigError

logger = logging.getLogger(__name__)

CHECKED_ENV: Final[str] = "REMAT_OFFLOAD_HOST_MEMORY_CHECKED"
"""Set by the launcher in its workers' environment once it has checked the node's host memory."""


def offloads(policy: Any) -> bool:
    """Whether a `CheckpointPolicy` sends anything to host memory (``offload: true``, mode ``offload``, per layer)."""
    return bool(policy.offload or policy.mode == "offload"
                or any(o.offload or o.mode == "offload" for o in policy.layers))


def check_offload_host_memory(cfg: Any, *, local_ranks: int, world_size: int,
                              available: int | None = None) -> int:
    """Raise `ConfigError` when the offloaded activations of ``cfg`` (a `RecipeConfig`) on ``local_ranks`` ranks
    of this node need more host memory than is ``available`` (default: read now); return the bytes needed per node
    (0 when nothing is offloaded), logged when it fits."""
    if not offloads(cfg.distributed.policy) or not _offloads_from_a_gpu(cfg.distributed.device):
        return 0
    from remat.estimate.api import estimate_memory, settings_from_recipe

    try:
        model, settings = settings_from_recipe(cfg, target="cuda", world_size=world_size)
        per_rank = estimate_memory(model, settings).host_peak_bytes
    except ConfigError as err:
        logger.warning("host memory for activation offload not checked: the estimate cannot model this recipe (%s)",
                       err)
        return 0
    needed = per_rank * local_ranks
    if available is None:
        from remat.memory.host import available_host_bytes

        available = available_host_bytes()
    ranks = f"{local_ranks} rank{'s' if local_ranks > 1 else ''} on this node x {_gib(per_rank)} GiB"
    if available is None:
        logger.warning("activation offload will hold %s GiB of host memory (%s); available host memory is unknown "
                       "here (no psutil, no /proc/meminfo)", _gib(needed), ranks)
        return needed
    if needed > available:
        raise ConfigError(
            f"distributed.activation_checkpointing: offloading activations needs {_gib(needed)} GiB of host memory "
            f"({ranks}; {needed:,} bytes) but {_gib(available)} GiB ({available:,} bytes) is available; use fewer "
            "tokens per micro-batch (step_scheduler.local_batch_size, dataset.seq_length), no offload, or more "
            "nodes with fewer ranks each")
    logger.info("activation offload will hold at most %s GiB of host memory on this node (%s; %s GiB available)",
                _gib(needed), ranks, _gib(available))
    return needed


@contextlib.contextmanager
def checked_before_launch(cfg: Any, *, local_ranks: int | None, world_size: int | None) -> Iterator[None]:
    """The launcher's check (once per node, when it knows the ranks), then, while the block launches the workers,
    the mark in the environment that spares them a second one."""
    if local_ranks is None or world_size is None:
        yield
        return
    check_offload_host_memory(cfg, local_ranks=local_ranks, world_size=world_size)
    before = os.environ.get(CHECKED_ENV)
    os.environ[CHECKED_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[CHECKED_ENV]
        else:
            os.environ[CHECKED_ENV] = before


def check_in_worker(cfg: Any, *, local_ranks: int, world_size: int) -> None:
    """A worker's check, unless its launcher made it already."""
    if os.environ.get(CHECKED_ENV) != "1":
        check_offload_host_memory(cfg, local_ranks=local_ranks, world_size=world_size)


def _offloads_from_a_gpu(device: str) -> bool:
    if device == "cpu":
        return False
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return True


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f}"
