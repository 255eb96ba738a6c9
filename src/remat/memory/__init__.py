"""Exact memory accounting: the live-tensor tracker and the per-step peak meter (CUDA allocator, tracked tensors or
RSS). The estimate of a step's peak before a run is `remat.estimate`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "LiveTensorTracker": "remat.memory.tracker",
    "StepMemoryMeter": "remat.memory.meter",
    "MemoryReading": "remat.memory.meter",
    "max_over_ranks": "remat.memory.meter",
}

__all__ = [
    "LiveTensorTracker",
    "MemoryReading",
    "StepMemoryMeter",
    "max_over_ranks",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.memory.meter import MemoryReading, StepMemoryMeter, max_over_ranks
    from remat.memory.tracker import LiveTensorTracker
