"""Exact memory accounting: the live-tensor tracker and the per-step peak meter (CUDA allocator, tracked tensors or
RSS). The estimate of a step's peak before a run is `remat.estimate`."""

from __future__ import annotations

from remat.memory.meter import MEMORY_SOURCES, MemoryReading, MemorySource, StepMemoryMeter, max_over_ranks
from remat.memory.tracker import CATEGORIES, LiveTensorTracker, StorageListener

__all__ = [
    "CATEGORIES",
    "MEMORY_SOURCES",
    "LiveTensorTracker",
    "MemoryReading",
    "MemorySource",
    "StepMemoryMeter",
    "StorageListener",
    "max_over_ranks",
]
