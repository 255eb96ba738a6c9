"""What recompute costs in seconds: `RecomputeRates` prices each op class at its own rate.

A plan's recompute is counted by op class on fake tensors (`remat.planner.measure.OpCounts`, NOTE [ What recompute
costs by op class ]): FLOPs, of which attention's, and the bytes memory-bound ops write. Its predicted time is

    seconds = (flops - attention_flops) / flops_per_second
              + attention_flops / attention_flops_per_second
              + memory_bytes / memory_bytes_per_second

with the rates `remat profile --write-calibration` fits on the device (`remat.planner.calibration`). A rate left
unset prices its class like the matmuls (attention) or not at all (memory-bound bytes): with ``flops_per_second``
alone the time is FLOPs over one throughput, as the planner priced recompute before it counted by class, and the
plans are the same. The planner compares plans in *FLOP-equivalents* (`RecomputeRates.cost`: the time at
``flops_per_second``, an integer), so that its exact search over assignments of modes to blocks keeps integer sums.

This module loads neither torch nor transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from remat.errors import ConfigError


@dataclass(frozen=True)
class RecomputeRates:
    """The device's rates for recompute: matmul ``flops_per_second``; ``attention_flops_per_second`` (None: the
    matmul rate); ``memory_bytes_per_second`` for the bytes memory-bound ops write (None: not priced)."""

    flops_per_second: float
    attention_flops_per_second: float | None = None
    memory_bytes_per_second: float | None = None

    def __post_init__(self) -> None:
        for name in ("flops_per_second", "attention_flops_per_second", "memory_bytes_per_second"):
            value = getattr(self, name)
            if value is None and name != "flops_per_second":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ConfigError(f"{name}: got {value!r}; allowed: a finite number > 0")

    @property
    def by_class(self) -> bool:
        """Whether any class is priced apart from the matmuls."""
        return self.attention_flops_per_second is not None or self.memory_bytes_per_second is not None

    def cost(self, flops: int, attention_flops: int = 0, memory_bytes: int = 0) -> int:
        """The recompute's time in FLOP-equivalents at ``flops_per_second`` (exactly ``flops`` without class
        rates)."""
        extra = 0.0
        if self.attention_flops_per_second is not None:
            extra += attention_flops * (self.flops_per_second / self.attention_flops_per_second - 1.0)
        if self.memory_bytes_per_second is not None:
            extra += memory_bytes * self.flops_per_second / self.memory_bytes_per_second
        return flops + round(extra)

    def cost_of(self, mode_cost: Any) -> int:
        """`cost` of a `remat.planner.measure.ModeCost`'s recompute."""
        return self.cost(mode_cost.recompute_flops, mode_cost.recompute_attention_flops,
                         mode_cost.recompute_memory_bytes)

    def seconds(self, cost: int) -> float:
        """The time of ``cost`` FLOP-equivalents."""
        return cost / self.flops_per_second

    def describe(self) -> str:
        """One phrase: the rates recompute is priced at."""
        words = [f"{self.flops_per_second / 1e12:g} TFLOP/s"]
        if self.attention_flops_per_second is not None:
            words.append(f"attention {self.attention_flops_per_second / 1e12:g} TFLOP/s")
        if self.memory_bytes_per_second is not None:
            words.append(f"memory-bound ops {self.memory_bytes_per_second / 1e9:g} GB/s")
        return ", ".join(words)

    def to_dict(self) -> dict[str, float | None]:
        """JSON-ready (its keys name per-second rates)."""
        return {"flops_per_second": self.flops_per_second,
                "attention_flops_per_second": self.attention_flops_per_second,
                "memory_bytes_per_second": self.memory_bytes_per_second}
