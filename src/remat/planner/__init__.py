"""The planner: per-layer activation checkpointing with the least predicted recompute that fits a memory budget.

`plan_activation_checkpointing(model_or_recipe, memory_budget=...)` returns an `ActivationPlan`, which
`remat.apply_activation_checkpointing` accepts; a recipe's ``distributed.activation_checkpointing: auto`` is planned
by `plan_recipe_auto` (what `remat finetune` calls before the build), and `remat plan` prints plans for several
budgets (`Planner` answers one budget after another for one step). The planner sits above the estimate
(`remat.estimate`), which prices every plan it considers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "plan_activation_checkpointing": "remat.planner.api",
    "plan_recipe": "remat.planner.api",
    "plan_recipe_auto": "remat.planner.api",
    "Planner": "remat.planner.planner",
    "ActivationPlan": "remat.planner.result",
}

__all__ = [
    "ActivationPlan",
    "Planner",
    "plan_activation_checkpointing",
    "plan_recipe",
    "plan_recipe_auto",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.planner.api import plan_activation_checkpointing, plan_recipe, plan_recipe_auto
    from remat.planner.planner import Planner
    from remat.planner.result import ActivationPlan
