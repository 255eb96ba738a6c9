"""Distributed training: one process, DDP or FSDP2 (+ tensor parallelism), launched through torchrun."""

from remat.distributed.env import ProcessEnv, under_torchrun
from remat.distributed.grad_norm import clip_grad_norm, clip_grad_norm_tensor, total_grad_norm
from remat.distributed.setup import MIXED_PRECISION, STRATEGIES, DistributedSetup, validate_settings

__all__ = ["MIXED_PRECISION", "STRATEGIES", "DistributedSetup", "ProcessEnv", "clip_grad_norm", "clip_grad_norm_tensor",
           "total_grad_norm", "under_torchrun",
           "validate_settings"]
