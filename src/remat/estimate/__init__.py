"""The memory estimate: one training step of a recipe simulated on fake tensors (the recipe's own build and step,
under ``FakeTensorMode``), its allocations replayed through a model of the CUDA caching allocator.

`estimate_memory` and `MemoryEstimate` are the API (also re-exported as ``remat.estimate_memory``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "CachingAllocatorModel": "remat.estimate.allocator",
    "MemoryEstimate": "remat.estimate.api",
    "estimate_memory": "remat.estimate.api",
    "resolve_model": "remat.estimate.api",
    "settings_from_recipe": "remat.estimate.api",
    "ESTIMATE_CATEGORIES": "remat.estimate.replay",
    "StepSettings": "remat.estimate.settings",
    "SimulatedRun": "remat.estimate.simulate",
    "simulate_step": "remat.estimate.simulate",
}

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.estimate.allocator import CachingAllocatorModel
    from remat.estimate.api import MemoryEstimate, estimate_memory, resolve_model, settings_from_recipe
    from remat.estimate.replay import ESTIMATE_CATEGORIES
    from remat.estimate.settings import StepSettings
    from remat.estimate.simulate import SimulatedRun, simulate_step
