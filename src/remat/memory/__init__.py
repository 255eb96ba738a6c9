"""Memory accounting: the exact live-tensor tracker, the per-step peak meter, and the estimate of a step's peak
simulated on fake tensors (`estimate_memory`)."""

from __future__ import annotations

from remat.memory.allocator import CachingAllocatorModel
from remat.memory.allocator_replay import ESTIMATE_CATEGORIES
from remat.memory.estimate import MemoryEstimate, estimate_memory, resolve_model, settings_from_recipe
from remat.memory.meter import MEMORY_SOURCES, MemoryReading, MemorySource, StepMemoryMeter, max_over_ranks
from remat.memory.simulate import StepSettings, simulate_step
from remat.memory.tracker import CATEGORIES, LiveTensorTracker, StorageListener

__all__ = [
    "CATEGORIES",
    "ESTIMATE_CATEGORIES",
    "MEMORY_SOURCES",
    "CachingAllocatorModel",
    "LiveTensorTracker",
    "MemoryEstimate",
    "MemoryReading",
    "MemorySource",
    "StepMemoryMeter",
    "StepSettings",
    "StorageListener",
    "estimate_memory",
    "max_over_ranks",
    "resolve_model",
    "settings_from_recipe",
    "simulate_step",
]
