"""Memory accounting: the exact live-tensor tracker and the per-step peak meter."""

from __future__ import annotations

from remat.memory.meter import MEMORY_SOURCES, MemoryReading, MemorySource, StepMemoryMeter, max_over_ranks
from remat.memory.tracker import CATEGORIES, LiveTensorTracker

__all__ = [
    "CATEGORIES",
    "MEMORY_SOURCES",
    "LiveTensorTracker",
    "MemoryReading",
    "MemorySource",
    "StepMemoryMeter",
    "max_over_ranks",
]
