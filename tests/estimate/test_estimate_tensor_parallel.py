"""`remat estimate --tp-size N` and ``estimate_memory(..., tp_size=N)``: one tensor-parallel rank's peak (its share of
each block's linear layers and heads, over FSDP2), planned by ``auto`` too, and the layouts that cannot be split
refused in one line. That the estimate equals each rank's tracked peak of a real ``tp_size`` 2 run is checked in
tests/distributed/test_context_parallel.py (``fsdp2-tp2-selective-plain-512``)."""

from __future__ import annotations

import pytest

from remat.cli import main
from remat.errors import ConfigError
from remat.estimate.api import estimate_memory
from remat.estimate.settings import StepSettings
from remat.planner import plan_activation_checkpointing

STEP = StepSettings(batch_size=1, seq_length=512, policy="none", target="cpu", strategy="fsdp2", world_size=2)


def test_a_tensor_parallel_rank_holds_its_share_of_the_block_weights_and_activations() -> None:
    """Over 2 ranks: tp 2 keeps every embedding and norm whole on each rank (dp 1) where dp 2 shards them all, so it
    holds more parameters; its block activations (per head, per MLP column) are about halved."""
    one = estimate_memory("tiny-llama", STEP, strategy="single", world_size=1)
    dp2 = estimate_memory("tiny-llama", STEP)
    tp2 = estimate_memory("tiny-llama", STEP, tp_size=2)
    assert dp2.breakdown["parameters"] < tp2.breakdown["parameters"] < one.breakdown["parameters"]
    assert tp2.breakdown["activations"] < 0.8 * dp2.breakdown["activations"]


def test_auto_plans_a_tensor_parallel_step_within_its_budget() -> None:
    step = {"batch_size": 2, "seq_length": 512, "strategy": "fsdp2", "world_size": 2, "tp_size": 2, "target": "cpu"}
    none, full = (estimate_memory("tiny-llama", policy=p, **step).peak_bytes for p in ("none", "full"))
    budget = (none + full) // 2
    plan = plan_activation_checkpointing("tiny-llama", memory_budget=f"{budget}B", **step)
    assert full <= plan.peak_bytes <= budget
    assert plan.policy.describe() not in ("none", "full")


def test_cli_tp_size_names_the_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--preset", "tiny-llama", "--batch-size", "1", "--seq-length", "256", "--target", "cpu",
                 "--strategy", "fsdp2", "--world-size", "4", "--tp-size", "2"]) == 0
    assert "fsdp2 over 4 ranks (dp 2 x tp 2: one rank's peak)" in capsys.readouterr().out


@pytest.mark.parametrize(("options", "message"), [
    ({"strategy": "ddp", "tp_size": 2}, r"^tp_size: 2 needs strategy 'fsdp2' \(got 'ddp'\); allowed with 'ddp': 1$"),
    ({"world_size": 2, "tp_size": 4}, r"^tp_size: cp_size 1 x tp_size 4 does not divide world_size 2"),
    ({"world_size": 4, "cp_size": 2, "tp_size": 4}, r"^tp_size: cp_size 2 x tp_size 4 does not divide world_size 4"),
    ({"tp_size": 0}, r"^tp_size: got 0; allowed: an integer >= 1$"),
])
def test_layouts_that_cannot_be_split_are_one_line(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        estimate_memory("tiny-llama", STEP, **options)  # type: ignore[arg-type]
