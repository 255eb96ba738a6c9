"""A sample of benchmarks/sweep_estimate.py in the suite: the estimate (``target="cpu"``) of a tiny config of each
model type equals the tracked peak of the real CPU step within 0.5% (they are equal to the byte today), or the model
is refused in one line; nothing crashes. The sample spans dense, sliding-window with softcaps, mixture-of-experts
with sliding windows, latent-attention MoE and state-space families; the whole mapping runs in the benchmark
(benchmarks/results/sweep_estimate.md)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

WITHIN = ["llama", "gemma2", "cohere2_moe", "deepseek_v4", "mamba"]


@pytest.fixture
def sweep(benchmark_script: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_script("sweep_estimate")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", WITHIN)
def test_the_estimate_equals_the_real_cpu_step(sweep: ModuleType, model_type: str) -> None:
    for policy in ("none", "full"):
        row = sweep.sweep_one(model_type, policy)
        if row["outcome"] == "not built":  # an older transformers without the type, or where the shrink fails
            pytest.skip(f"{model_type}: the generic tiny shrink builds no runnable model with this transformers")
        assert row["outcome"] == "within 0.5%", row
        assert row["estimate"] == row["real"], row  # to the byte


def test_a_model_that_cannot_be_simulated_is_refused_in_one_line(sweep: ModuleType) -> None:
    row = sweep.sweep_one("jetmoe", "none")
    assert row["outcome"] == "refused", row
    assert "on values fake tensors do not have" in row["message"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["dbrx", "reformer"])
def test_auto_plans_where_the_estimate_answers(sweep: ModuleType, model_type: str) -> None:
    """The planner's block measurement runs blocks as the estimate's step does: dbrx's data-dependent expert routing
    (``nonzero`` on the router's choice) falls back to balanced routing in both, and Reformer's reversible blocks,
    which compute without autograd, are measured instead of crashing in their backward."""
    peaks = {}
    for policy in ("none", "full"):
        row = sweep.sweep_one(model_type, policy)
        if row["outcome"] == "not built":
            pytest.skip(f"{model_type}: the tiny shrink builds no runnable model with this transformers")
        if row["outcome"] == "refused":  # an older transformers rejects the tiny config: auto must say the same
            plan = sweep.plan_one(model_type, 2**30)
            assert (plan["outcome"], plan["message"]) == ("refused", row["message"]), (row, plan)
            return
        assert row["outcome"].startswith("within"), row
        peaks[policy] = row["estimate"]
    row = sweep.plan_one(model_type, (peaks["none"] + peaks["full"]) // 2)
    assert row["outcome"] == "planned", row


def test_auto_refuses_what_the_estimate_refuses_in_the_same_line(sweep: ModuleType) -> None:
    estimate = sweep.sweep_one("jetmoe", "none")
    plan = sweep.plan_one("jetmoe", 2**30)
    assert estimate["outcome"] == plan["outcome"] == "refused", (estimate, plan)
    assert plan["message"] == estimate["message"]
