"""Run-time re-planning of ``auto`` (remat.adaptation.retry + remat.adaptation), on real CPU steps of a tiny Llama
with dropout: a first plan that under-predicts its peak, or an injected out-of-memory error, is re-planned and the
step retried, ending with the same losses and gradient norms as a run planned right from the start (exactly equal:
checkpointing recomputes bit for bit on the CPU, the retried step redraws the same dropout masks and micro-batches);
the bound; a resume after a re-plan; the config key."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import tiny_recipe

from remat.checkpointing import CheckpointPolicy
from remat.errors import ConfigError, MemoryBudgetError
from remat.estimate.api import MemoryEstimate
from remat.planner import Planner
from remat.planner.api import planner_for_recipe
from remat.adaptation.adapter import PlanAdapter, adapter_for_recipe, forward_backward_peak
from remat.distributed.config import AUTO_KEYS
from remat.recipes.finetune import FinetuneRecipe, RunResult
from remat.recipes.loader import validate_recipe
from remat.adaptation.retry import Overshoot, size
from remat.adaptation.oom_notes import OutOfMemoryNote, write_note

GIB = 2**30

MODEL = {"preset": "tiny-llama", "config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                                            "attention_dropout": 0.1}}
UNDER_PREDICTION = 0.7
"""The injected planning error: every estimate the biased planner sees is this share of the true (exact) peak."""


def recipe(tmp_path: Path, *, policy: Any = "none", max_steps: int = 3, **extra: Any) -> dict[str, Any]:
    data = tiny_recipe(seed=3, output_dir=str(tmp_path / "run"), model=MODEL, dataset={"seq_length": 64},
                       step_scheduler={"max_steps": max_steps},
                       lr_scheduler={"warmup_steps": 1, "decay": "constant"},  # one schedule for 2, 3 and 4 steps
                       checkpoint={"enabled": False}, logging={"memory": "tracked"},
                       distributed={"activation_checkpointing": policy})
    for key, value in extra.items():
        data[key] = {**data.get(key, {}), **value}
    planner_keys = {key: data["distributed"].pop(key) for key in list(data["distributed"]) if key in AUTO_KEYS}
    if planner_keys:  # the planner's keys belong to auto: a pinned policy here is what auto planned
        planned = {} if policy == "auto" else {"plan": policy}
        data["distributed"]["activation_checkpointing"] = {"mode": "auto", **planned, **planner_keys}
    return data


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "remat-cache"))


@pytest.fixture(scope="module")
def planner(tmp_path_factory: pytest.TempPathFactory) -> Planner:
    """The true planner of the recipe's step (the CPU estimate is the exact tracked peak)."""
    return planner_for_recipe(validate_recipe(recipe(tmp_path_factory.mktemp("probe"))), target="cpu")


@pytest.fixture(scope="module")
def budget(planner: Planner) -> int:
    none, full = (planner.estimate(CheckpointPolicy(mode=mode)).peak_bytes for mode in ("none", "full"))
    return full + (none - full) // 3


def biased(planner: Planner) -> Planner:
    """A copy of ``planner`` whose estimates are `UNDER_PREDICTION` of the truth (shares the true cache)."""
    return scaled(planner, UNDER_PREDICTION)


def scaled(planner: Planner, factor: float) -> Planner:
    """A copy of ``planner`` whose estimates (peaks, phase peaks, breakdown) are ``factor`` times the truth (shares
    the true cache)."""
    copy_ = copy.copy(planner)
    true_estimate = planner.estimate

    def estimate(policy: CheckpointPolicy) -> MemoryEstimate:
        est = true_estimate(policy)
        return dataclasses.replace(est, peak_bytes=int(est.peak_bytes * factor),
                                   phase_peaks={k: int(v * factor) for k, v in est.phase_peaks.items()},
                                   breakdown={k: int(v * factor) for k, v in est.breakdown.items()})

    copy_.estimate = estimate  # type: ignore[method-assign]
    return copy_


def train(data: dict[str, Any], *, replanner: PlanAdapter | None = None,
          prepare: Callable[[FinetuneRecipe], None] = lambda job: None) -> tuple[FinetuneRecipe, RunResult]:
    job = FinetuneRecipe(validate_recipe(data), replanner=replanner)
    job.setup()
    prepare(job)
    return job, job.run()


def outcomes(result: RunResult) -> list[tuple[int, float, float]]:
    return [(r.step, r.loss, r.grad_norm) for r in result.records]


@pytest.fixture(scope="module")
def reference(planner: Planner, budget: int, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[int, float, float]]:
    """Four steps planned right from the start."""
    right = planner.plan(budget).policy
    _, result = train(recipe(tmp_path_factory.mktemp("reference"), policy=right.to_dict(), max_steps=4))
    assert all(r.mem_bytes <= budget for r in result.records)
    return outcomes(result)


def test_an_under_predicting_first_plan_is_replanned_and_the_step_retried(
        planner: Planner, budget: int, reference: list[tuple[int, float, float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    wrong = biased(planner).plan(budget).policy
    assert planner.estimate(wrong).peak_bytes > budget  # the injection works: the first plan does not fit
    adapter = PlanAdapter(lambda: biased(planner), budget_bytes=budget, policy=wrong)
    job, result = train(recipe(tmp_path, policy=wrong.to_dict()), replanner=adapter)
    out = capsys.readouterr().out
    assert outcomes(result) == reference[:3]
    # One re-plan, in step 1 (before the optimizer state exists: the correction leaves it out of the prediction).
    assert job.retry is not None and job.retry.replans == 1
    lines = [line for line in out.splitlines() if line.startswith("re-plan ")]
    assert len(lines) == 1
    assert lines[0].startswith("re-plan 1/3 at step 1: the step's peak ")
    assert f"exceeded the budget {size(budget)}; activation checkpointing {wrong.describe()} (predicted" in lines[0]
    assert "retrying step 1" in lines[0]
    # The plan in force now truly fits (true estimate), and every logged step did.
    assert adapter.policy != wrong and job.dist.plan is not None and job.dist.plan.policy == adapter.policy
    assert planner.estimate(adapter.policy).peak_bytes <= budget
    assert all(r.mem_bytes <= budget for r in result.records)
    assert [r.step for r in result.records] == [1, 2, 3] and job.batches.state_dict() is not None


def test_an_injected_out_of_memory_error_is_replanned_and_the_step_retried(
        planner: Planner, budget: int, reference: list[tuple[int, float, float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    right = planner.plan(budget).policy
    adapter = PlanAdapter(lambda: planner, budget_bytes=budget, policy=right)
    calls: list[int] = []

    def inject(job: FinetuneRecipe) -> None:
        forward = job.compute_loss

        def flaky(batch: Any, **kwargs: Any) -> torch.Tensor:
            calls.append(job.step)
            # Step 2, second micro-batch: the first one's gradients are already accumulated.
            if job.step == 1 and calls.count(1) == 2:
                forward(batch, **kwargs)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return forward(batch, **kwargs)

        job.compute_loss = flaky  # type: ignore[assignment]

    job, result = train(recipe(tmp_path, policy=right.to_dict()), replanner=adapter, prepare=inject)
    out = capsys.readouterr().out
    assert outcomes(result) == reference[:3]
    assert calls.count(1) == 4  # step 2: two micro-batches, the second failed; then both again
    assert job.retry is not None and job.retry.replans == 1
    line = next(line for line in out.splitlines() if line.startswith("re-plan "))
    assert line.startswith("re-plan 1/3 at step 2: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB "
                           f"(injected)); activation checkpointing {right.describe()} ")
    # The new plan keeps less: predicted at most 90% of the failed plan's prediction.
    assert planner.estimate(adapter.policy).peak_bytes <= 0.9 * planner.estimate(right).peak_bytes


def test_more_overshoots_than_max_replans_stop_with_what_would_help(planner: Planner, budget: int,
                                                                    tmp_path: Path) -> None:
    right = planner.plan(budget).policy
    adapter = PlanAdapter(lambda: planner, budget_bytes=budget, policy=right)

    def always(job: FinetuneRecipe) -> None:
        def oom(batch: Any, **kwargs: Any) -> torch.Tensor:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

        job.compute_loss = oom  # type: ignore[assignment]

    with pytest.raises(MemoryBudgetError, match=(
            rf"distributed.activation_checkpointing.memory_budget: step 1 does not fit {size(budget)} after 1 "
            r"re-plan\(s\) \(activation_checkpointing.max_replans: 1\): out of memory \(CUDA out of memory "
            r"\(injected\)\) under the last plan, .+ \(predicted peak \d+\.\d\d MiB\)\. What would help: a larger "
            r"memory_budget .*a smaller micro-batch.*the fused loss.*fsdp2.*max_replans")):
        train(recipe(tmp_path, policy=right.to_dict(), distributed={"max_replans": 1}), replanner=adapter,
              prepare=always)
    assert adapter.policy != right  # it did re-plan once before giving up


def test_an_out_of_memory_error_in_the_optimizer_update_is_not_retried(planner: Planner, budget: int,
                                                                       tmp_path: Path) -> None:
    right = planner.plan(budget).policy
    adapter = PlanAdapter(lambda: planner, budget_bytes=budget, policy=right)

    def in_update(job: FinetuneRecipe) -> None:
        def oom(*args: Any, **kwargs: Any) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory (injected in the update)")

        job.optimizer.step = oom  # type: ignore[method-assign]

    with pytest.raises(torch.OutOfMemoryError, match="injected in the update"):
        train(recipe(tmp_path, policy=right.to_dict()), replanner=adapter, prepare=in_update)
    assert adapter.policy == right  # no re-plan: the update may be half applied


def test_a_budget_nothing_can_meet_after_correction_is_one_clear_error(planner: Planner, budget: int) -> None:
    full = CheckpointPolicy(mode="full")
    adapter = PlanAdapter(lambda: planner, budget_bytes=budget, policy=full)
    peak = forward_backward_peak(planner.estimate(full))
    with pytest.raises(ConfigError, match=r"no plan fits the corrected planning budget .* MiB \(the budget .* MiB "
                                          r"less the prediction's error\): distributed.activation_checkpointing.memory_budget: nothing fits"):
        adapter.replan(Overshoot(step=1, budget_bytes=budget, peak_bytes=2 * peak))


def test_a_checkpoint_after_a_replan_resumes_with_the_replanned_policy(
        planner: Planner, budget: int, reference: list[tuple[int, float, float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    wrong = biased(planner).plan(budget).policy
    saving = {"checkpoint": {"enabled": True}, "step_scheduler": {"ckpt_every_steps": 2}}
    first = PlanAdapter(lambda: biased(planner), budget_bytes=budget, policy=wrong)
    job, result = train(recipe(tmp_path, policy=wrong.to_dict(), max_steps=2, **saving), replanner=first)
    assert job.retry is not None and job.retry.replans >= 1
    saved = json.loads((Path(result.last_checkpoint or "") / "train_state.json").read_text())
    assert saved["replan"]["planner"]["policy"] == first.policy.to_dict()
    capsys.readouterr()
    # Resumed as `remat finetune` would: the recipe's auto planned anew (the same wrong first plan).
    second = PlanAdapter(lambda: biased(planner), budget_bytes=budget, policy=wrong)
    resumed, rest = train(recipe(tmp_path, policy=wrong.to_dict(), max_steps=4, **saving), replanner=second)
    out = capsys.readouterr().out
    assert "activation checkpointing: resumed with the plan re-planned at run time" in out
    assert resumed.dist.plan is not None and resumed.dist.plan.policy == first.policy == second.policy
    assert resumed.retry is not None and resumed.retry.replans == job.retry.replans  # no new re-plan
    assert "re-plan " not in out
    assert outcomes(result) + outcomes(rest) == reference


def test_max_replans_is_a_validated_recipe_key(tmp_path: Path) -> None:
    assert validate_recipe(recipe(tmp_path, policy="auto")).distributed.auto.max_replans == 3
    with pytest.raises(ConfigError, match=r"distributed.activation_checkpointing.max_replans"):
        validate_recipe(recipe(tmp_path, distributed={"max_replans": -1}))


def test_the_adapter_of_an_auto_recipe_holds_its_budget_and_first_policy(tmp_path: Path) -> None:
    cfg = validate_recipe(recipe(tmp_path, policy={"mode": "selective"}, distributed={"memory_budget": "3MiB"}))
    adapter = adapter_for_recipe(cfg)
    assert adapter.budget_bytes == 3 * 2**20 and adapter.policy == CheckpointPolicy(mode="selective")
    assert adapter.state_dict() == {"policy": {"mode": "selective"}, "planning_budget": 3 * 2**20,
                                    "budget_bytes": 3 * 2**20, "predicted_peak_bytes": None,
                                    "overshot_peak_bytes": None}
    # A saved state of another budget is not taken over; one of this budget is.
    assert adapter.load_state_dict({**adapter.state_dict(), "policy": {"mode": "full"}, "budget_bytes": 2**30}) is None
    assert adapter.load_state_dict({**adapter.state_dict(), "policy": {"mode": "full"}}) == CheckpointPolicy(mode="full")
    assert adapter.policy == CheckpointPolicy(mode="full")


def test_remat_finetune_gives_auto_runs_and_their_workers_a_replanner(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from remat.cli import main
    given: list[Any] = []

    def record(job: FinetuneRecipe) -> RunResult:
        given.append(job.replanner)
        return RunResult()

    monkeypatch.setattr(FinetuneRecipe, "run", record)
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(recipe(tmp_path, policy="auto", distributed={"memory_budget": "1GiB"})))
    assert main(["finetune", str(path)]) == 0
    assert isinstance(given[-1], PlanAdapter) and given[-1].budget_bytes == GIB
    assert given[-1].policy == CheckpointPolicy(mode="none")  # 1 GiB: nothing to checkpoint
    assert main(["finetune", str(path), "--distributed.activation_checkpointing.max_replans", "0"]) == 0
    assert given[-1] is None
    assert main(["finetune", str(path), "--distributed.activation_checkpointing", "full"]) == 0 and given[-1] is None
    # Every process of an auto run reads the plan from the run's plan file ("planned by auto" is part of the
    # recipe, never told through the environment or the command line), and a pinned policy is never re-planned.
    saved = json.loads((tmp_path / "run" / "auto_plan.json").read_text())
    assert saved["activation_checkpointing"]["plan"] == {"mode": "none"}
    assert main(["finetune", str(path)]) == 0
    assert isinstance(given[-1], PlanAdapter) and given[-1].policy == CheckpointPolicy(mode="none")
    assert not any(name.startswith("REMAT_") and "AUTO" in name for name in os.environ)


@pytest.mark.parametrize("same_budget", [True, False])
def test_a_restarted_run_replans_from_an_out_of_memory_note_before_its_first_step(
        same_budget: bool, planner: Planner, budget: int, reference: list[tuple[int, float, float]],
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What a restart after an out-of-memory error on one of several ranks does (the 2-rank run through torchrun is
    in tests/distributed/test_replan_ranks.py): the note's plan is re-planned once, before step 1 here (nothing to
    resume), and the run gives the same numbers; a note of another budget is ignored, and a finished run clears it."""
    right = planner.plan(budget).policy
    failed = PlanAdapter(lambda: planner, budget_bytes=budget if same_budget else budget + 1, policy=right)
    data = recipe(tmp_path, policy=right.to_dict())
    checkpoints = Path(data["output_dir"]) / "checkpoints"
    write_note(checkpoints, OutOfMemoryNote(step=2, rank=1, error="CUDA out of memory (injected)",
                                            first_update=False, replans=0, budget_bytes=failed.budget_bytes,
                                            planner=failed.state_dict()))
    adapter = PlanAdapter(lambda: planner, budget_bytes=budget, policy=right)
    job, result = train(data, replanner=adapter)
    out = capsys.readouterr().out
    assert outcomes(result) == reference[:3]
    assert job.retry is not None and not list(checkpoints.glob("oom-replan-*"))
    if not same_budget:
        assert job.retry.replans == 0 and adapter.policy == right
        assert (f"re-plan: ignored the out-of-memory note of step 2 (rank 1): it was planned for another budget; "
                f"this run keeps its plan for {size(budget)}") in out
        return
    assert job.retry.replans == 1 and adapter.policy != right
    line = next(line for line in out.splitlines() if line.startswith("re-plan "))
    assert line.startswith("re-plan 1/3 at step 2: out of memory on rank 1 (CUDA out of memory (injected)); "
                           f"activation checkpointing {right.describe()} ")
    assert line.endswith("; the workers were restarted: resuming after step 0")
    assert planner.estimate(adapter.policy).peak_bytes <= 0.9 * planner.estimate(right).peak_bytes
