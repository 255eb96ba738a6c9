"""Before an offloading recipe trains: does this node have the host memory its offloaded activations need?

The bytes come from the estimate (`remat.estimate.estimate_memory`, ``host_peak_bytes``): the recipe's own step on
fake tensors, through the same offload hooks, so every policy (``offload: true`` of the kept block inputs, mode
``offload`` of everything a block saves) and every model is counted as it will run, in seconds and without
allocating. Per node the need is that figure times the ranks on the node (every rank holds its own host copies);
it is compared with the host memory available now (`remat.memory.host.available_host_bytes`; pinned buffers come out
of it too). Too little is one `ConfigError` line before anything is built; enough is one log line saying how much
the run will hold. On the CPU the offload copies nothing (the tensors already live in host memory): nothing to
check.

``remat finetune --nproc-per-node N`` checks once per node, in the launcher, and records the verdict beside the
run's plan file, in ``<output_dir>/host_memory.json`` (`HOST_MEMORY_FILE`): per host, the ranks checked for, the
bytes needed and the launcher's process id, under a fingerprint of the recipe (without its ``checkpoint`` section)
and the world size. A worker skips its own check only for a verdict of its own recipe, world size, host and ranks
recorded by a launcher that is one of its ancestor processes (so a file left by an earlier launch, or by another
node's launcher on a shared file system, is never taken for this one); any other worker checks for its node itself.
Nothing passes through the environment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from remat.errors import ConfigError
from remat.recipes.run_safety.output_paths import HOST_MEMORY_FILE

logger = logging.getLogger(__name__)


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
    """The launcher's check (once per node, when it knows the ranks), recorded for its workers while the block
    launches them (the record is removed after)."""
    if local_ranks is None or world_size is None:
        yield
        return
    needed = check_offload_host_memory(cfg, local_ranks=local_ranks, world_size=world_size)
    recorded = needed > 0 and _record(cfg, local_ranks=local_ranks, world_size=world_size, needed=needed)
    try:
        yield
    finally:
        if recorded:
            _forget(cfg)


def check_in_worker(cfg: Any, *, local_ranks: int, world_size: int) -> None:
    """A worker's check, unless its launcher recorded one for this recipe, world size, host and ranks."""
    if not _recorded_for_this_worker(cfg, local_ranks=local_ranks, world_size=world_size):
        check_offload_host_memory(cfg, local_ranks=local_ranks, world_size=world_size)


def _record(cfg: Any, *, local_ranks: int, world_size: int, needed: int) -> bool:
    """Write this host's verdict into the run's `HOST_MEMORY_FILE` (other hosts' entries of the same fingerprint
    kept); False, with a warning, when it cannot be written (the workers then check themselves)."""
    from remat._files import write_atomic

    path = Path(cfg.output_dir) / HOST_MEMORY_FILE
    fingerprint = _fingerprint(cfg, world_size)
    saved = _read(path, fingerprint) or {"fingerprint": fingerprint, "hosts": {}}
    saved["hosts"][socket.gethostname()] = {"local_ranks": local_ranks, "needed_bytes": needed,
                                            "launcher_pid": os.getpid()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(saved, indent=2) + "\n", "host memory verdict", durable=False)
    except (ConfigError, OSError) as err:
        logger.warning("the host-memory verdict was not recorded for the workers (%s); each checks itself", err)
        return False
    return True


def _forget(cfg: Any) -> None:
    """Remove this host's entry (the whole file when it was the last)."""
    from remat._files import write_atomic

    path = Path(cfg.output_dir) / HOST_MEMORY_FILE
    saved = _read(path, None)
    if saved is None:
        return
    saved["hosts"].pop(socket.gethostname(), None)
    with contextlib.suppress(ConfigError, OSError):
        if saved["hosts"]:
            write_atomic(path, json.dumps(saved, indent=2) + "\n", "host memory verdict", durable=False)
        else:
            path.unlink()


def _recorded_for_this_worker(cfg: Any, *, local_ranks: int, world_size: int) -> bool:
    saved = _read(Path(cfg.output_dir) / HOST_MEMORY_FILE, _fingerprint(cfg, world_size))
    entry = saved["hosts"].get(socket.gethostname()) if saved is not None else None
    return (isinstance(entry, dict) and entry.get("local_ranks") == local_ranks
            and isinstance(entry.get("launcher_pid"), int) and entry["launcher_pid"] in _ancestors())


def _read(path: Path, fingerprint: str | None) -> dict[str, Any] | None:
    """The verdict file when it is a regular file of at most 1 MiB holding ``fingerprint`` (any, for None)."""
    from remat._files import read_regular_bytes

    if not path.is_file() or path.is_symlink():
        return None
    try:
        saved = json.loads(read_regular_bytes(path, "host memory verdict", limit=2**20, follow_symlinks=False))
    except (ConfigError, OSError, ValueError):
        return None
    if not (isinstance(saved, dict) and isinstance(saved.get("hosts"), dict)):
        return None
    return saved if fingerprint is None or saved.get("fingerprint") == fingerprint else None


def _fingerprint(cfg: Any, world_size: int) -> str:
    from remat.planner.handoff import recipe_fingerprint

    return recipe_fingerprint(cfg, world_size=world_size)


def _ancestors() -> set[int]:
    """The process ids above this one (Linux's /proc; empty elsewhere, so a worker there checks itself)."""
    out: set[int] = set()
    pid = os.getppid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the command name is the parent's id
    return out


def _offloads_from_a_gpu(device: str) -> bool:
    if device == "cpu":
        return False
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return True


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f}"
