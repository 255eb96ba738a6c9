"""Learning-rate schedule: linear warmup, then cosine, linear or constant decay to a floor."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from remat.recipes.config import LRSchedulerConfig


def lr_multiplier(step: int, cfg: LRSchedulerConfig, max_steps: int) -> float:
    """The factor applied to the base learning rate before optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    decay_steps = cfg.decay_steps or max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.decay == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_lr_scheduler(optimizer: Optimizer, cfg: LRSchedulerConfig, max_steps: int) -> LambdaLR:
    """A ``LambdaLR`` following ``lr_multiplier``; its state dict resumes exactly."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, max_steps))
