"""The planner's half of relaxing a plan at run time (`remat.adaptation.relax_watch` decides when to ask): from what a stable
stretch measured, a plan with less predicted recompute time that, corrected by that measurement, fits with a margin.

The plan in force predicted a forward+backward peak ``predicted``; the stretch measured ``measured`` (its highest
step, max over ranks): ``error = measured - predicted`` (negative when the plan kept less than predicted). The new
plan is chosen for ``min(target - error, target x predicted / measured)`` where ``target`` is the budget less the
margin (the same two corrections as a re-plan, `remat.adaptation`, whichever asks for less), and never for as
much as the predicted peak of a plan that went over the budget in this run. It is taken only when its predicted
recompute (and host copies) take less time than the plan in force's, and its forward+backward prediction, corrected
both ways, stays within ``target``.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.checkpointing import CheckpointPolicy
from remat.checkpointing.policy import Mode
from remat.errors import ConfigError
from remat.estimate.api import MemoryEstimate
from remat.planner.measure import BlockMeasurements
from remat.planner.planner import Planner
from remat.planner.result import ActivationPlan
from remat.adaptation.relax_watch import Stretch
from remat.adaptation.retry import size
from remat.recipes.step import UPDATE_PHASE


@dataclass(frozen=True)
class Relaxation:
    """A relaxed ``plan``, chosen for ``planning_budget``; predicted recompute (+ copies) seconds per optimizer step
    of the plan in force (``before_s``) and of the new one (``after_s``); ``corrected_peak_bytes``: the new plan's
    forward+backward prediction corrected by the stretch's measurement."""

    plan: ActivationPlan
    planning_budget: int
    before_s: float
    after_s: float
    corrected_peak_bytes: int

    def describe(self) -> str:
        """The predicted gain and the corrected peak, for the log line."""
        change = 100 * (self.after_s - self.before_s) / self.before_s if self.before_s else 0.0
        return (f"predicted recompute {self.before_s:.3g} s -> {self.after_s:.3g} s a step ({change:+.0f}%), "
                f"corrected peak {size(self.corrected_peak_bytes)}")


def relaxed_plan(planner: Planner, policy: CheckpointPolicy, stretch: Stretch, *,
                 barred_peak: int | None = None) -> Relaxation | str:
    """The relaxed plan for the plan in force ``policy`` after ``stretch`` (module docstring), or why there is none.
    ``barred_peak``: the lowest predicted peak of a plan that went over the budget in this run (None: none did)."""
    modes = modes_of(policy, planner.measurements)
    if modes is None:
        return "the plan in force is not one the planner makes, so it cannot be priced"
    predicted = forward_backward_peak(planner.estimate(policy))
    measured = max(stretch.peak_bytes, 1)
    error = measured - predicted
    target = stretch.target_bytes
    planning = min(target - error, target * predicted // measured)
    barred = ""
    if barred_peak is not None and barred_peak <= planning:
        planning, barred = barred_peak - 1, f" (below {size(barred_peak)}, predicted for a plan that went over)"
    current = planner.price("in force", policy, modes, planning)
    assert planner.flops_per_second is not None
    before = current.seconds(planner.flops_per_second, planner.host_bandwidth)
    if current.peak_bytes >= planning:
        return f"no room beyond it: the corrected planning budget is {size(max(planning, 0))}{barred}"
    try:
        plan = planner.plan(planning)
    except ConfigError:
        return f"no plan fits the corrected planning budget {size(planning)}"
    after = plan.recompute_seconds + plan.transfer_seconds
    if plan.policy == policy or after >= before:
        return f"no plan predicted faster fits the corrected planning budget {size(planning)}"
    new = forward_backward_peak(planner.estimate(plan.policy))
    corrected = max(new + error, new * measured // max(predicted, 1))
    if corrected > target:
        return (f"the faster plan {plan.policy.describe()} would peak at {size(corrected)} once corrected, over "
                f"{size(target)}")
    return Relaxation(plan=plan, planning_budget=planning, before_s=before, after_s=after,
                      corrected_peak_bytes=corrected)


def modes_of(policy: CheckpointPolicy, measurements: BlockMeasurements) -> tuple[Mode, ...] | None:
    """The mode of every block under ``policy``; None for a policy the planner never makes (segments, tiling, a
    block pattern, or a mode some block cannot take)."""
    if policy.segments is not None or policy.tiled or policy.block_pattern is not None:
        return None
    modes: list[Mode] = []
    for index in range(measurements.num_blocks):
        override = policy.override_for(index)
        mode = override.mode if override is not None else (
            policy.mode if index % policy.every_n_layers == 0 else "none")
        if all(cost.mode != mode for cost in measurements.kind_of(index).costs):
            return None
        modes.append(mode)
    return tuple(modes)


def forward_backward_peak(estimate: MemoryEstimate) -> int:
    """The estimate's highest peak before the optimizer update (forward, loss, backward of every micro-batch); its
    whole-step peak when it has no phases."""
    peaks = [peak for phase, peak in estimate.phase_peaks.items() if not phase.startswith(UPDATE_PHASE)]
    return max(peaks) if peaks else estimate.peak_bytes
