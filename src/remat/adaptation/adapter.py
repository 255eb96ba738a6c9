"""`PlanAdapter`: plans ``auto`` again during a run, from what a step measured (the `remat.adaptation.retry.Replanner`
that `remat finetune` hands the recipe).

The plan's prediction was off by what the step measured: ``error = measured - predicted``, both the peak of
forward and backward (the part checkpointing changes; the prediction is the estimate's highest phase peak outside
the optimizer update). The new plan is chosen for a planning budget that leaves room for that error however it
scales: ``min(budget - error, budget * predicted / measured)``, i.e. the correction that assumes the estimate is
off by a constant and the one that assumes it is off by a factor, whichever asks for more (in the first step, before
the optimizer state exists, the prediction is taken without that state). After an out-of-memory
error nothing was measured: the planning budget becomes `OOM_SHRINK` less than the failed plan's prediction.
Either way the planning budget is below the failed plan's predicted peak, so the new plan keeps less. The lowest
predicted peak of a plan that went over is remembered: a later relax (`relax`, `remat.adaptation.relaxing`) never goes
back to a plan predicted to keep as much.

The `Planner` (block measurements on fake tensors, a few seconds) is built on the first re-plan only: a run that
fits never pays for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from remat._child import call_in_child, child_call, needs_fresh_process
from remat.checkpointing import CheckpointPolicy, parse_policy
from remat.errors import ConfigError
from remat.planner.api import default_target, planner_for_recipe, recipe_budget
from remat.planner.planner import Planner
from remat.adaptation.relaxing import forward_backward_peak, relaxed_plan
from remat.recipes.config import RecipeConfig
from remat.adaptation.relax_watch import Stretch
from remat.adaptation.retry import Overshoot, Replan, StepRetry, size

if TYPE_CHECKING:
    from remat.recipes.finetune import FinetuneRecipe

logger = logging.getLogger(__name__)

OOM_SHRINK: Final[float] = 0.10
"""After an out-of-memory error, the next plan is planned for this share less than the failed plan's prediction."""


class PlanAdapter:
    """Re-plans for ``budget_bytes`` (per rank) starting from ``policy`` (the plan applied at start).

    ``make_planner`` builds the `Planner` of the run's step (`remat.planner.api.planner_for_recipe`); it is called
    once, on the first re-plan (or when a resumed run needs a description). ``child``: the recipe and world size to
    re-plan in a child process (`remat._child`) when its step needs one there (`needs_fresh_process`: FSDP2 or
    context parallelism, from a process that joined a process group); see `replan_in_child`.
    """

    def __init__(self, make_planner: Callable[[], Planner], *, budget_bytes: int, policy: CheckpointPolicy,
                 child: tuple[RecipeConfig, int] | None = None) -> None:
        self._make_planner = make_planner
        self._planner: Planner | None = None
        self._budget = budget_bytes
        self._child = child
        self.policy = policy
        self.planning_budget = budget_bytes
        self.predicted_peak: int | None = None
        self.overshot_peak: int | None = None

    @property
    def budget_bytes(self) -> int:
        """The budget every step must fit (the recipe's ``activation_checkpointing.memory_budget``, in bytes)."""
        return self._budget

    @property
    def planner(self) -> Planner:
        """The run's `Planner` (built on first use)."""
        if self._planner is None:
            self._planner = self._make_planner()
        return self._planner

    @property
    def _in_child(self) -> bool:
        if self._child is None:
            return False
        d = self._child[0].distributed
        return needs_fresh_process(d.strategy, d.cp_size)

    def describe(self) -> str:
        """The policy in force and its predicted peak."""
        if self.predicted_peak is None and not self._in_child:
            self.predicted_peak = self.planner.estimate(self.policy).peak_bytes
        known = f" (predicted peak {size(self.predicted_peak)})" if self.predicted_peak is not None else ""
        return self.policy.describe() + known

    def replan(self, overshoot: Overshoot) -> Replan:
        """The plan for the corrected planning budget (module docstring); `ConfigError` when nothing fits it."""
        if self._in_child:
            return self._answer_in_child(overshoot)
        estimate = self.planner.estimate(self.policy)
        self.overshot_peak = min(estimate.peak_bytes, self.overshot_peak or estimate.peak_bytes)
        predicted = forward_backward_peak(estimate)
        if overshoot.first_update:  # the estimate is of a later step, whose peak holds the optimizer state
            predicted -= estimate.breakdown.get("optimizer_state", 0)
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
        self.policy, self.planning_budget, self.predicted_peak = plan.policy, planning, plan.peak_bytes
        return Replan(policy=plan.policy, old=old, new=f"{self.describe()} planned for {size(planning)}")

    def relax(self, stretch: Stretch) -> Replan | str:
        """A plan with less predicted recompute that fits what ``stretch`` measured (`remat.adaptation.relaxing`), or why
        the plan in force stays."""
        if not self.policy.enabled:  # nothing recomputed: no planner built, no child started
            return "it checkpoints nothing, so there is nothing to relax"
        if self._in_child:
            return self._answer_in_child(stretch)
        old = self.describe()
        relaxed = relaxed_plan(self.planner, self.policy, stretch, barred_peak=self.overshot_peak)
        if isinstance(relaxed, str):
            return relaxed
        plan = relaxed.plan
        self.policy, self.planning_budget, self.predicted_peak = plan.policy, relaxed.planning_budget, plan.peak_bytes
        return Replan(policy=plan.policy, old=old,
                      new=f"{self.describe()} planned for {size(relaxed.planning_budget)}; {relaxed.describe()}")

    def _answer_in_child(self, request: Overshoot | Stretch) -> Replan | str:
        assert self._child is not None
        answer, state = call_in_child(replan_in_child, *self._child, self.state_dict(), request)
        self.load_state_dict(state)
        return answer  # type: ignore[no-any-return]

    def guard(self, recipe: FinetuneRecipe) -> StepRetry:
        """The run-time watch of ``recipe``'s steps under this adapter (what `FinetuneRecipe` asks for)."""
        return StepRetry.for_recipe(self, recipe)

    def state_dict(self) -> dict[str, Any]:
        """The policy in force, its predicted peak, the planning budget it was chosen for and the lowest predicted
        peak of a plan that went over (JSON types)."""
        return {"policy": self.policy.to_dict(), "planning_budget": self.planning_budget,
                "budget_bytes": self._budget, "predicted_peak_bytes": self.predicted_peak,
                "overshot_peak_bytes": self.overshot_peak}

    def load_state_dict(self, state: Mapping[str, Any]) -> CheckpointPolicy | None:
        """Take a saved re-planned policy back when it was re-planned for this same budget; returns it when it
        differs from the policy in force, else None. A checkpoint of another budget is not taken (the run plans
        anew for its own)."""
        if "policy" not in state or state.get("budget_bytes") != self._budget:
            return None
        policy = parse_policy(state["policy"], key="train_state.replan.planner.policy")
        self.planning_budget = int(state.get("planning_budget", self._budget))
        self.predicted_peak = state.get("predicted_peak_bytes")
        self.overshot_peak = state.get("overshot_peak_bytes")
        if policy == self.policy:
            return None
        self.policy = policy
        return policy


def adapter_for_recipe(cfg: RecipeConfig, *, world_size: int = 1) -> PlanAdapter:
    """The `PlanAdapter` of a recipe whose ``auto`` was planned (`plan_recipe_auto`; its plan is the policy applied
    at start), for its ``memory_budget`` on ``world_size`` processes."""
    target = default_target(cfg.distributed.device)
    options = {"world_size": world_size} if world_size > 1 and cfg.distributed.strategy != "single" else {}
    return PlanAdapter(lambda: planner_for_recipe(cfg, target=target, **options),
                       budget_bytes=recipe_budget(cfg, None, target), policy=cfg.distributed.policy,
                       child=(cfg, world_size))


@child_call
def replan_in_child(cfg: RecipeConfig, world_size: int, state: dict[str, Any],
                    request: Overshoot | Stretch) -> tuple[Replan | str, dict[str, Any]]:
    """`PlanAdapter.replan` (an `Overshoot`) or `PlanAdapter.relax` (a `Stretch`) of the run's adapter in ``state``,
    run in a child process (`remat._child`): the answer and the adapter's new state. A `ConfigError` (no plan fits)
    comes back to the worker with its message."""
    adapter = adapter_for_recipe(cfg, world_size=world_size)
    adapter.load_state_dict(state)
    answer = adapter.replan(request) if isinstance(request, Overshoot) else adapter.relax(request)
    return answer, adapter.state_dict()
