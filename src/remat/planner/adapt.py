"""`PlanAdapter`: plans ``auto`` again during a run, from what a step measured (the `remat.recipes.replan.Replanner`
that `remat finetune` hands the recipe).

The plan's prediction was off by what the step measured: ``error = measured - predicted``, both the peak of
forward and backward (the part checkpointing changes; the prediction is the estimate's highest phase peak outside
the optimizer update). The new plan is chosen for a planning budget that leaves room for that error however it
scales: ``min(budget - error, budget * predicted / measured)``, i.e. the correction that assumes the estimate is
off by a constant and the one that assumes it is off by a factor, whichever asks for more. After an out-of-memory
error nothing was measured: the planning budget becomes `OOM_SHRINK` less than the failed plan's prediction.
Either way the planning budget is below the failed plan's predicted peak, so the new plan keeps less.

The `Planner` (block measurements on fake tensors, a few seconds) is built on the first re-plan only: a run that
fits never pays for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Final

from remat.checkpointing import CheckpointPolicy, parse_policy
from remat.errors import ConfigError
from remat.estimate.api import MemoryEstimate
from remat.planner.api import _POLICY_KEY, default_target, planner_for_recipe, recipe_budget
from remat.planner.planner import Planner
from remat.recipes.config import RecipeConfig
from remat.recipes.loader import apply_overrides, validate_recipe
from remat.recipes.replan import UPDATE_PHASE, Overshoot, Replan, size

logger = logging.getLogger(__name__)

OOM_SHRINK: Final[float] = 0.10
"""After an out-of-memory error, the next plan is planned for this share less than the failed plan's prediction."""


class PlanAdapter:
    """Re-plans for ``budget_bytes`` (per rank) starting from ``policy`` (the plan applied at start).

    ``make_planner`` builds the `Planner` of the run's step (`remat.planner.api.planner_for_recipe`); it is called
    once, on the first re-plan (or when a resumed run needs a description).
    """

    def __init__(self, make_planner: Callable[[], Planner], *, budget_bytes: int,
                 policy: CheckpointPolicy) -> None:
        self._make_planner = make_planner
        self._planner: Planner | None = None
        self._budget = budget_bytes
        self.initial = policy
        self.policy = policy
        self.planning_budget = budget_bytes

    @property
    def budget_bytes(self) -> int:
        """The budget every step must fit (the recipe's ``distributed.memory_budget``, in bytes)."""
        return self._budget

    @property
    def planner(self) -> Planner:
        """The run's `Planner` (built on first use)."""
        if self._planner is None:
            self._planner = self._make_planner()
        return self._planner

    def describe(self) -> str:
        """The policy in force and its predicted peak."""
        return f"{self.policy.describe()} (predicted peak {size(self.planner.estimate(self.policy).peak_bytes)})"

    def replan(self, overshoot: Overshoot) -> Replan:
        """The plan for the corrected planning budget (module docstring); `ConfigError` when nothing fits it."""
        estimate = self.planner.estimate(self.policy)
        predicted = forward_backward_peak(estimate)
        if overshoot.peak_bytes is not None:
            measured = overshoot.peak_bytes
            planning = min(self._budget - (measured - predicted), self._budget * predicted // max(measured, 1))
        else:
            planning = int(min(self.planning_budget, estimate.peak_bytes) * (1 - OOM_SHRINK))
        planning = max(1, min(planning, estimate.peak_bytes - 1))
        old = self.describe()
        try:
            plan = self.planner.plan(planning)
        except ConfigError as err:
            raise ConfigError(f"no plan fits the corrected planning budget {size(planning)} (the budget "
                              f"{size(self._budget)} less the prediction's error): {err}") from err
        self.policy, self.planning_budget = plan.policy, planning
        return Replan(policy=plan.policy, old=old,
                      new=f"{self.describe()} planned for {size(planning)}")

    def state_dict(self) -> dict[str, Any]:
        """The policy in force and the planning budget it was chosen for (JSON types)."""
        return {"policy": self.policy.to_dict(), "planning_budget": self.planning_budget,
                "budget_bytes": self._budget}

    def load_state_dict(self, state: Mapping[str, Any]) -> CheckpointPolicy | None:
        """Take a saved re-planned policy back when it was re-planned for this same budget; returns it when it
        differs from the policy applied at start, else None. A checkpoint of another budget is not taken (the
        run plans anew for its own)."""
        if "policy" not in state or state.get("budget_bytes") != self._budget:
            return None
        policy = parse_policy(state["policy"], key="train_state.replan.planner.policy")
        self.planning_budget = int(state.get("planning_budget", self._budget))
        if policy == self.policy:
            return None
        self.policy = policy
        return policy


def adapter_for_recipe(cfg: RecipeConfig, *, world_size: int = 1) -> PlanAdapter:
    """The `PlanAdapter` of a recipe whose ``auto`` was resolved into ``cfg``'s policy (the policy applied at
    start), for ``distributed.memory_budget`` on ``world_size`` processes, as `load_planned_recipe` planned it."""
    probe = validate_recipe(apply_overrides(cfg.model_dump(mode="json", by_alias=True), [(_POLICY_KEY, "none")]))
    target = default_target(cfg.distributed.device)
    options = {"world_size": world_size} if world_size > 1 and probe.distributed.strategy != "single" else {}
    return PlanAdapter(lambda: planner_for_recipe(probe, target=target, **options),
                       budget_bytes=recipe_budget(probe, None, target), policy=cfg.distributed.activation_checkpointing)


def forward_backward_peak(estimate: MemoryEstimate) -> int:
    """The estimate's highest peak before the optimizer update (forward, loss, backward of every micro-batch); its
    whole-step peak when it has no phases."""
    peaks = [peak for phase, peak in estimate.phase_peaks.items() if not phase.startswith(UPDATE_PHASE)]
    return max(peaks) if peaks else estimate.peak_bytes
