"""Mixture-of-experts models in every dtype remat trains (#23 item 1b): Mixtral (routed experts only) and Qwen2-MoE
(routed experts and a shared expert) are estimated on the CPU to the byte of the real step's tracked peak in float32,
bfloat16 and float16, without and with checkpointing (selective measured equal too, left out for time), and the planner plans them within a budget that the real step then keeps."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import pytest
import torch

from remat.estimate import StepSettings
from remat.estimate.api import estimate_memory
from remat.models import ModelConfig
from remat.planner import Planner

MOE: dict[str, dict[str, Any]] = {
    "mixtral": {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96, "num_local_experts": 4,
                "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 256},
    "qwen2_moe-shared": {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 96,
                         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 4,
                         "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "vocab_size": 256},
}


@pytest.mark.parametrize("policy", ["none", "full"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("model", list(MOE))
def test_the_estimate_equals_the_real_steps_peak(model: str, dtype: str, policy: str,
                                                 benchmark_script: Callable[[str], ModuleType]) -> None:
    settings = StepSettings(batch_size=2, seq_length=64, dtype=dtype, policy=policy, target="cpu")
    estimate = estimate_memory(MOE[model], settings)
    measured = benchmark_script("bench_estimate_cuda").measure(MOE[model], settings, torch.device("cpu"))
    assert estimate.peak_bytes == measured["max_memory_allocated"]


@pytest.mark.parametrize("model", list(MOE))
def test_a_float32_plan_fits_its_budget_in_the_real_step(model: str,
                                                         benchmark_script: Callable[[str], ModuleType]) -> None:
    step = StepSettings(batch_size=2, seq_length=64, dtype="float32", target="cpu")
    planner = Planner.from_settings(ModelConfig(config=MOE[model]), step)
    peaks = {c.label: c.peak_bytes for c in planner.uniform_candidates(2**40)}
    budget = (peaks["full"] + peaks["none"]) // 2
    plan = planner.plan(budget)
    assert plan.peak_bytes <= budget and plan.policy.enabled
    real = benchmark_script("bench_estimate_cuda").measure(
        MOE[model], StepSettings(batch_size=2, seq_length=64, dtype="float32", target="cpu",
                                 policy=plan.policy.to_dict()), torch.device("cpu"))
    assert real["max_memory_allocated"] <= budget
