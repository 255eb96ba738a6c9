"""The allowed values of the ``distributed`` settings, in a module without torch (the recipe schema and the command
line's help read them before anything heavy is imported)."""

from __future__ import annotations

from typing import Literal

Strategy = Literal["single", "ddp", "fsdp2"]
#: Values of ``distributed.strategy``.
STRATEGIES: tuple[str, ...] = ("single", "ddp", "fsdp2")
#: Values of ``distributed.mixed_precision`` (FSDP2's parameter dtype).
MIXED_PRECISION: tuple[str, ...] = ("bfloat16", "float16", "float32")
#: Values of ``distributed.device``: ``auto`` picks CUDA when every local rank can have a GPU of its own.
DEVICE_CHOICES: tuple[str, ...] = ("auto", "cpu", "cuda")
