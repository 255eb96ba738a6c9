"""Distributed training: one process, DDP or FSDP2 (+ tensor parallelism), launched through torchrun."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "DistributedSetup": "remat.distributed.setup",
    "clip_grad_norm": "remat.distributed.grad_norm",
}

__all__ = [
    "DistributedSetup",
    "clip_grad_norm",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.distributed.grad_norm import clip_grad_norm
    from remat.distributed.setup import DistributedSetup
