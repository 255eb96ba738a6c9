"""Relaxing ``auto`` at run time (remat.adaptation.relax_watch + remat.adaptation.relaxing), on real CPU steps of the tiny Llama of
test_replan.py: a first plan made by a planner that over-predicts every peak by 20% (so it recomputes more than the
budget needs) relaxes after a stable stretch to a plan with less recompute, with the same losses and gradient norms
as a run given that plan from the start; a relaxed plan that goes over is re-planned, the step retried, and relaxing
stops; a resumed run takes the same decisions; the decision rules, the key and its help."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import test_replan
import torch
from test_replan import outcomes, recipe, scaled, train

from remat.checkpointing import CheckpointPolicy
from remat.errors import ConfigError
from remat.planner import Planner
from remat.adaptation.adapter import PlanAdapter, forward_backward_peak
from remat.planner.choose import totals
from remat.adaptation.relaxing import modes_of, relaxed_plan
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe
from remat.adaptation.relax_watch import RELAX_MARGIN, RelaxWatch, Stretch
from remat.adaptation.retry import size

# test_replan's fixtures: the true planner of its recipe's step, the budget, an isolated tokenizer cache.
planner, budget, _isolated_cache = test_replan.planner, test_replan.budget, test_replan._isolated_cache

OVER_PREDICTION = 1.2
"""The conservative first planner: every estimate it sees is this many times the true (exact) peak."""
RELAX = {"relax_after_steps": 2}


def over(planner: Planner) -> Planner:
    return scaled(planner, OVER_PREDICTION)


def relax_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("relax", "re-plan"))]


def flops(planner: Planner, policy: CheckpointPolicy) -> int:
    modes = modes_of(policy, planner.measurements)
    assert modes is not None
    return totals(modes, planner.measurements)[1]


@pytest.fixture(scope="module")
def first(planner: Planner, budget: int) -> CheckpointPolicy:
    """The conservative first plan: it recomputes more than the true plan for the budget."""
    policy = over(planner).plan(budget).policy
    assert flops(planner, policy) > flops(planner, planner.plan(budget).policy)
    return policy


def test_a_conservative_first_plan_relaxes_after_a_stable_stretch(
        planner: Planner, budget: int, first: CheckpointPolicy, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    adapter = PlanAdapter(lambda: over(planner), budget_bytes=budget, policy=first)
    job, result = train(recipe(tmp_path / "relaxed", policy=first.to_dict(), max_steps=7, distributed=RELAX),
                        replanner=adapter)
    lines = relax_lines(capsys.readouterr().out)
    relaxed = adapter.policy
    # Steps 2 and 3 are the stretch (step 1, the first update, does not count); step 3 relaxes.
    assert len(lines) == 2, lines
    stretch_peak = max(record.mem_bytes for record in result.records[1:3])  # steps differ: document-wise attention
    assert lines[0].startswith(f"relax 1 at step 3: the last 2 steps peaked at {size(stretch_peak)}, ")
    assert (f"% of the budget {size(budget)}; activation checkpointing {first.describe()} (predicted peak "
            f"{size(over(planner).estimate(first).peak_bytes)}) -> {relaxed.describe()} (predicted peak ") in lines[0]
    assert " a step (-" in lines[0] and "%), corrected peak " in lines[0] and lines[0].endswith("; from step 4")
    # The relaxed plan gets a stretch of its own (steps 4, 5) and one question; none after it (steps 6, 7).
    assert lines[1].startswith("relax: kept the plan at step 5 (the last 2 steps peaked at ")
    assert job.retry is not None and job.retry.relax.relaxes == 1 and job.retry.replans == 0
    assert job.dist.plan is not None and job.dist.plan.policy == relaxed != first
    assert flops(planner, relaxed) < flops(planner, first)  # less recompute...
    assert all(r.mem_bytes <= budget for r in result.records)  # ...and every step still fits
    assert max(r.mem_bytes for r in result.records[3:]) > max(r.mem_bytes for r in result.records[:3])
    # The same losses and gradient norms as a run planned with the relaxed plan from the start.
    _, from_start = train(recipe(tmp_path / "from-start", policy=relaxed.to_dict(), max_steps=7))
    assert outcomes(result) == outcomes(from_start)


def test_a_relaxed_plan_that_goes_over_is_replanned_and_never_relaxed_again(
        planner: Planner, budget: int, first: CheckpointPolicy, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    adapter = PlanAdapter(lambda: over(planner), budget_bytes=budget, policy=first)
    fired: list[int] = []
    held: list[torch.Tensor] = []

    def push_over(job: FinetuneRecipe) -> None:
        """Step 4 (the relaxed plan's first), first attempt: hold enough to go over the budget."""
        def clear(module: Any, args: Any) -> None:
            held.clear()

        def hold(module: Any, args: Any, output: Any) -> None:
            if job.step == 3 and not fired:
                assert job.dist.plan is not None
                fired.append(1)
                room = budget - forward_backward_peak(planner.estimate(job.dist.plan.policy))
                held.append(torch.ones((room + budget // 4) // 4))

        job.model.register_forward_pre_hook(clear)
        job.model.register_forward_hook(hold)

    job, result = train(recipe(tmp_path / "over", policy=first.to_dict(), max_steps=8, distributed=RELAX),
                        replanner=adapter, prepare=push_over)
    lines = relax_lines(capsys.readouterr().out)
    assert fired and len(lines) == 2, lines
    assert lines[0].startswith("relax 1 at step 3: ")
    assert lines[1].startswith("re-plan 1/3 at step 4: the step's peak ") and lines[1].endswith(
        "retrying step 4; relaxing stops for this run")
    assert job.retry is not None and job.retry.replans == 1 and job.retry.relax.stopped
    assert job.retry.relax.relaxes == 1  # steps 5-8 are stable, but no further question is asked
    # The re-plan keeps less than the relaxed plan that went over, and remembers its predicted peak.
    assert adapter.overshot_peak is not None
    assert over(planner).estimate(adapter.policy).peak_bytes < adapter.overshot_peak
    assert all(r.mem_bytes <= budget for r in result.records)
    _, from_start = train(recipe(tmp_path / "from-start", policy=adapter.policy.to_dict(), max_steps=8))
    assert outcomes(result) == outcomes(from_start)


def test_a_resumed_run_takes_the_same_relax_decisions(planner: Planner, budget: int, first: CheckpointPolicy,
                                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def run(name: str, max_steps: int, **extra: Any) -> tuple[FinetuneRecipe, Any, list[str]]:
        adapter = PlanAdapter(lambda: over(planner), budget_bytes=budget, policy=first)
        job, result = train(recipe(tmp_path / name, policy=first.to_dict(), max_steps=max_steps, distributed=RELAX,
                                   **extra), replanner=adapter)
        return job, result, relax_lines(capsys.readouterr().out)

    whole, whole_result, whole_lines = run("whole", 6)
    saving = {"checkpoint": {"enabled": True}, "step_scheduler": {"ckpt_every_steps": 2}}
    part, part_result, part_lines = run("parts", 4, **saving)  # relaxes at step 3, saves at step 4
    saved = json.loads((Path(part_result.last_checkpoint or "") / "train_state.json").read_text())["replan"]
    assert saved["relax"] == {"relaxes": 1, "stopped": False, "steps": 1, "peak_bytes": part_result.records[3].mem_bytes,
                              "asked": False, "relaxed_in_force": True}
    assert saved["planner"]["policy"] == part.dist.plan.policy.to_dict() != first.to_dict()  # type: ignore[union-attr]
    resumed, rest, rest_lines = run("parts", 6, **saving)
    assert resumed.retry is not None and resumed.retry.relax.relaxes == 1
    assert resumed.dist.plan is not None and resumed.dist.plan.policy == whole.dist.plan.policy  # type: ignore[union-attr]
    assert part_lines + rest_lines == whole_lines  # relaxed at step 3, kept at step 5: the same lines
    assert outcomes(part_result) + outcomes(rest) == outcomes(whole_result)


def test_an_exact_planner_keeps_its_plan_and_a_plan_that_went_over_is_never_chosen_again(
        planner: Planner, budget: int, first: CheckpointPolicy) -> None:
    right = planner.plan(budget).policy
    measured = forward_backward_peak(planner.estimate(right))
    stretch = Stretch(step=9, steps=2, peak_bytes=measured, budget_bytes=budget)
    answer = relaxed_plan(planner, right, stretch)
    assert isinstance(answer, str) and answer.startswith(("no room beyond it", "no plan predicted faster fits"))
    # The conservative plan relaxes, to the plan below; barred at that plan's predicted peak, it does not.
    biased = over(planner)
    measured = forward_backward_peak(planner.estimate(first))
    stretch = Stretch(step=9, steps=2, peak_bytes=measured, budget_bytes=budget)
    relaxed = relaxed_plan(biased, first, stretch)
    assert not isinstance(relaxed, str) and relaxed.after_s < relaxed.before_s
    assert relaxed.corrected_peak_bytes <= stretch.target_bytes == int(budget * (1 - RELAX_MARGIN))
    assert forward_backward_peak(planner.estimate(relaxed.plan.policy)) <= relaxed.corrected_peak_bytes
    barred = relaxed_plan(biased, first, stretch, barred_peak=relaxed.plan.peak_bytes)
    assert isinstance(barred, str) or barred.plan.peak_bytes < relaxed.plan.peak_bytes
    # Barred below the plan in force itself: nothing to relax to, and the answer says why.
    assert relaxed_plan(biased, first, stretch, barred_peak=biased.estimate(first).peak_bytes) == (
        f"no room beyond it: the corrected planning budget is {size(biased.estimate(first).peak_bytes - 1)} (below "
        f"{size(biased.estimate(first).peak_bytes)}, predicted for a plan that went over)")
    assert relaxed_plan(biased, CheckpointPolicy(mode="full", segments=2), stretch) == (
        "the plan in force is not one the planner makes, so it cannot be priced")


def test_the_watch_counts_stable_steps_asks_once_per_plan_and_stops_after_a_relaxed_plan_went_over() -> None:
    asked: list[Stretch] = []
    answers = [True, False]
    watch = RelaxWatch(3, lambda stretch: asked.append(stretch) or answers.pop(0))
    limit = 1000
    watch.after_step(1, 100, limit, first_update=True)  # not counted
    for step, peak in [(2, 900), (3, 960), (4, 950)]:  # 960 > 95% of the budget: the stretch starts over
        watch.after_step(step, peak, limit, first_update=False)
    assert watch.steps == 1 and not asked
    watch.after_step(5, 940, limit, first_update=False)
    watch.after_step(6, 920, limit, first_update=False)
    assert asked == [Stretch(step=6, steps=3, peak_bytes=950, budget_bytes=limit)] and watch.relaxes == 1
    assert watch.relaxed_in_force and watch.steps == 0 and not watch.asked
    for step in range(7, 10):
        watch.after_step(step, 500, limit, first_update=False)
    assert len(asked) == 2 and watch.asked  # kept: this plan is not asked about again
    for step in range(10, 20):
        watch.after_step(step, 500, limit, first_update=False)
    assert len(asked) == 2
    saved = json.loads(json.dumps(watch.state_dict()))
    again = RelaxWatch(3, lambda stretch: pytest.fail("asked"))
    again.load_state_dict(saved)
    assert again.state_dict() == watch.state_dict()
    assert watch.after_replan() is True and watch.stopped and not watch.relaxed_in_force
    assert watch.after_replan() is False  # already stopped
    for step in range(20, 30):
        watch.after_step(step, 500, limit, first_update=False)
    assert len(asked) == 2
    off = RelaxWatch(None, lambda stretch: pytest.fail("asked"))
    for step in range(1, 300):
        off.after_step(step, 1, limit, first_update=False)


def test_relax_after_steps_is_a_validated_recipe_key_shown_in_the_help(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert validate_recipe(recipe(tmp_path, policy="auto")).distributed.auto.relax_after_steps == 100
    off = recipe(tmp_path, distributed={"relax_after_steps": None})
    assert validate_recipe(off).distributed.auto.relax_after_steps is None
    for bad in (0, -3, "often", 2.5):
        with pytest.raises(ConfigError, match=r"distributed.activation_checkpointing.relax_after_steps"):
            validate_recipe(recipe(tmp_path, distributed={"relax_after_steps": bad}))
    from remat.cli import main

    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    assert ("distributed.activation_checkpointing.relax_after_steps  [int > 0 or null]  default 100"
            in capsys.readouterr().out)


def test_a_plan_that_checkpoints_nothing_is_kept_without_building_a_planner() -> None:
    def no_planner() -> Planner:
        raise AssertionError("the planner was built")

    adapter = PlanAdapter(no_planner, budget_bytes=2**30, policy=CheckpointPolicy(mode="none"))
    stretch = Stretch(step=101, steps=100, peak_bytes=2**20, budget_bytes=2**30)
    assert adapter.relax(stretch) == "it checkpoints nothing, so there is nothing to relax"
    assert adapter.policy == CheckpointPolicy(mode="none")
