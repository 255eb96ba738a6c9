"""The memory estimate: one training step of a recipe simulated on fake tensors (the recipe's own build and step,
under ``FakeTensorMode``), its allocations replayed through a model of the CUDA caching allocator.

`estimate_memory` and `MemoryEstimate` are the API (also re-exported as ``remat.estimate_memory``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "estimate_memory": "remat.estimate.api",
    "MemoryEstimate": "remat.estimate.api",
    "StepSettings": "remat.estimate.settings",
}

__all__ = [
    "MemoryEstimate",
    "StepSettings",
    "estimate_memory",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.estimate.api import MemoryEstimate, estimate_memory
    from remat.estimate.settings import StepSettings
