"""``DistributedSetup``: how the model is spread over processes, and the order in which memory savers are applied.

Order of application in ``parallelize``: activation checkpointing first (it wraps transformer blocks), then the
parallel wrapper of the strategy. Only ``single`` (one process) is implemented so far; ``ddp`` and ``fsdp2`` are
accepted by the schema so recipes written for them validate, and fail here with a clear message.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from remat.checkpointing import CheckpointPlan, apply_activation_checkpointing, parse_policy
from remat.errors import ConfigError

logger = logging.getLogger(__name__)

Strategy = Literal["single", "ddp", "fsdp2"]
STRATEGIES: tuple[str, ...] = ("single", "ddp", "fsdp2")
IMPLEMENTED: tuple[str, ...] = ("single",)


@dataclass
class DistributedSetup:
    """The parallelism of a run. Build it with ``DistributedSetup.build(...)``, then ``model = setup.parallelize(model)``."""

    strategy: Strategy = "single"
    activation_checkpointing: Any = False
    dp_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    plan: CheckpointPlan | None = None

    @classmethod
    def build(
        cls,
        strategy: Strategy = "single",
        activation_checkpointing: Any = False,
        dp_size: int | None = None,
        tp_size: int = 1,
        cp_size: int = 1,
        device: str | torch.device | None = None,
    ) -> DistributedSetup:
        """Validate the settings against the environment (e.g. torchrun's ``WORLD_SIZE``) and return the setup."""
        if strategy not in STRATEGIES:
            raise ConfigError(f"distributed.strategy: got {strategy!r}; allowed: {', '.join(STRATEGIES)}")
        parse_policy(activation_checkpointing, key="distributed.activation_checkpointing")
        if strategy not in IMPLEMENTED:
            raise ConfigError(
                f"distributed.strategy: {strategy!r} is not available in this version of remat yet; "
                f"use one of: {', '.join(IMPLEMENTED)}"
            )
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if strategy == "single" and world_size != 1:
            raise ConfigError(
                f"distributed.strategy: 'single' runs one process, but this was launched with WORLD_SIZE={world_size}; "
                "use strategy 'ddp' or 'fsdp2' for several processes"
            )
        for name, value in (("tp_size", tp_size), ("cp_size", cp_size), ("dp_size", dp_size or 1)):
            if value != 1:
                raise ConfigError(f"distributed.{name}: {value} needs several processes; strategy 'single' runs one")
        resolved = torch.device(device) if device is not None else _default_device()
        return cls(strategy=strategy, activation_checkpointing=activation_checkpointing, device=resolved)

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Apply activation checkpointing (recorded in ``self.plan``), then the strategy's wrapper; returns the model."""
        policy = parse_policy(self.activation_checkpointing, key="distributed.activation_checkpointing")
        self.plan = apply_activation_checkpointing(model, policy)
        return model.to(self.device)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
