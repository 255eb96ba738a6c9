"""The planner: per-layer activation checkpointing with the least predicted recompute that fits a memory budget.

`plan_activation_checkpointing(model_or_recipe, memory_budget=...)` returns an `ActivationPlan`, which
`remat.apply_activation_checkpointing` accepts; a recipe's ``distributed.activation_checkpointing: auto`` is
resolved by `load_planned_recipe` (what `remat finetune` calls), and `remat plan` prints plans for several budgets.
The planner sits above the estimate (`remat.estimate`), which prices every plan it considers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "load_planned_recipe": "remat.planner.api",
    "plan_activation_checkpointing": "remat.planner.api",
    "plan_recipe": "remat.planner.api",
    "planner_for_recipe": "remat.planner.api",
    "DEFAULT_MARGIN": "remat.planner.budget",
    "parse_budget": "remat.planner.budget",
    "DEFAULT_FLOPS_PER_SECOND": "remat.planner.planner",
    "Planner": "remat.planner.planner",
    "ActivationPlan": "remat.planner.result",
    "BlockChoice": "remat.planner.result",
    "Candidate": "remat.planner.result",
}

__all__ = [
    "DEFAULT_FLOPS_PER_SECOND",
    "DEFAULT_MARGIN",
    "ActivationPlan",
    "BlockChoice",
    "Candidate",
    "Planner",
    "load_planned_recipe",
    "parse_budget",
    "plan_activation_checkpointing",
    "plan_recipe",
    "planner_for_recipe",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.planner.api import load_planned_recipe, plan_activation_checkpointing, plan_recipe, planner_for_recipe
    from remat.planner.budget import DEFAULT_MARGIN, parse_budget
    from remat.planner.planner import DEFAULT_FLOPS_PER_SECOND, Planner
    from remat.planner.result import ActivationPlan, BlockChoice, Candidate
