"""Distributed training: one process, DDP or FSDP2 (+ tensor parallelism), launched through torchrun."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "ProcessEnv": "remat.distributed.env",
    "under_torchrun": "remat.distributed.env",
    "clip_grad_norm": "remat.distributed.grad_norm",
    "clip_grad_norm_tensor": "remat.distributed.grad_norm",
    "total_grad_norm": "remat.distributed.grad_norm",
    "MIXED_PRECISION": "remat.distributed.choices",
    "STRATEGIES": "remat.distributed.choices",
    "DistributedSetup": "remat.distributed.setup",
    "validate_settings": "remat.distributed.layout",
}

__all__ = ["MIXED_PRECISION", "STRATEGIES", "DistributedSetup", "ProcessEnv", "clip_grad_norm", "clip_grad_norm_tensor",
           "total_grad_norm", "under_torchrun",
           "validate_settings"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.distributed.env import ProcessEnv, under_torchrun
    from remat.distributed.grad_norm import clip_grad_norm, clip_grad_norm_tensor, total_grad_norm
    from remat.distributed.choices import MIXED_PRECISION, STRATEGIES
    from remat.distributed.layout import validate_settings
    from remat.distributed.setup import DistributedSetup
