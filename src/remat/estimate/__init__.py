"""The memory estimate: one training step of a recipe simulated on fake tensors (the recipe's own build and step,
under ``FakeTensorMode``), its allocations replayed through a model of the CUDA caching allocator.

`estimate_memory` and `MemoryEstimate` are the API (also re-exported as ``remat.estimate_memory``)."""

from __future__ import annotations

from remat.estimate.allocator import CachingAllocatorModel
from remat.estimate.api import MemoryEstimate, estimate_memory, resolve_model, settings_from_recipe
from remat.estimate.replay import ESTIMATE_CATEGORIES
from remat.estimate.settings import StepSettings
from remat.estimate.simulate import SimulatedRun, simulate_step

__all__ = [
    "ESTIMATE_CATEGORIES",
    "CachingAllocatorModel",
    "MemoryEstimate",
    "SimulatedRun",
    "StepSettings",
    "estimate_memory",
    "resolve_model",
    "settings_from_recipe",
    "simulate_step",
]
