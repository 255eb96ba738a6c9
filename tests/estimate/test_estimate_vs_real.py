"""The estimate (``target="cpu"``) against the exact peak of the same step run on real CPU tensors.

The reference is written here independently of the simulation: a real model, `CausalLMLoss`, the checkpointing
policy, AdamW, and `LiveTensorTracker` around a step after the first (and around the first step itself). Done-when of
issue 6: within 3% for at least 6 configurations; in practice the figures are equal to the byte.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from remat.checkpointing import apply_activation_checkpointing
from remat.loss import FusedLinearCrossEntropy, MaskedCrossEntropy
from remat.memory import LiveTensorTracker
from remat.estimate.api import MemoryEstimate, estimate_memory
from remat.estimate.simulate import IGNORE_INDEX, StepSettings, make_batch
from remat.models import ModelConfig, build_model
from remat.recipes.model_loss import CausalLMLoss

TOLERANCE = 0.03
SMALL = {"num_hidden_layers": 2, "vocab_size": 512}

CONFIGS: dict[str, dict[str, Any]] = {
    "none-plain-fp32": {"policy": "none", "loss": "plain"},
    "full-plain-fp32": {"policy": "full", "loss": "plain"},
    "selective-fused-fp32": {"policy": "selective", "loss": "fused"},
    "none-fused-autocast": {"policy": "none", "loss": "fused", "autocast": "bfloat16"},
    "attention-plain-autocast": {"policy": "attention", "loss": "plain", "autocast": "bfloat16"},
    "full-fused-bf16": {"policy": "full", "loss": "fused", "dtype": "bfloat16"},
    "mlp-plain-accumulate": {"policy": "mlp", "loss": "plain", "grad_accumulation": 2},
    "every2nd-plain-packed": {"policy": {"mode": "full", "every_n_layers": 2}, "loss": "plain",
                              "documents_per_row": 2},
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    """Tiny real steps are fastest on one thread (and on a busy machine, several threads mostly wait)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(settings: StepSettings) -> ModelConfig:
    return ModelConfig(preset="tiny-llama", config=SMALL, dtype=settings.dtype or "float32",
                       output_hidden_states=settings.loss == "fused")


def _real_peaks(settings: StepSettings) -> tuple[int, int]:
    """(first step's peak, second step's peak) of the step on real CPU tensors, tracked exactly."""
    torch.manual_seed(0)
    net = build_model(_model(settings))
    loss_fn = FusedLinearCrossEntropy() if settings.loss == "fused" else MaskedCrossEntropy()
    compute = CausalLMLoss(net, loss_fn, use_hidden_states=settings.loss == "fused")
    apply_activation_checkpointing(net, settings.policy)
    params = [p for p in compute.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    batch = make_batch(settings, net.config.vocab_size)
    autocast = (torch.autocast("cpu", dtype=getattr(torch, settings.autocast)) if settings.autocast
                else contextlib.nullcontext())

    def step() -> None:
        for _ in range(settings.grad_accumulation):
            micro = {k: v.clone() for k, v in batch.items()}
            tokens = int((micro["labels"][..., 1:] != IGNORE_INDEX).sum()) * settings.grad_accumulation
            with autocast:
                loss = compute(micro, num_label_tokens=tokens)
            loss.backward()
            del loss, micro
        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    peaks = []
    for _ in range(2):
        with LiveTensorTracker(module=compute, optimizer=optimizer) as tracker:
            step()
        peaks.append(tracker.peak_bytes)
    return peaks[0], peaks[1]


def _estimate(settings: StepSettings) -> MemoryEstimate:
    return estimate_memory(_model(settings), settings)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_estimate_matches_the_real_cpu_step(name: str) -> None:
    settings = StepSettings(batch_size=2, seq_length=64, target="cpu", **CONFIGS[name])
    estimate = _estimate(settings)
    first, steady = _real_peaks(settings)
    assert abs(estimate.peak_bytes - steady) <= TOLERANCE * steady, (estimate.peak_bytes, steady)
    assert abs(estimate.first_step_peak_bytes - first) <= TOLERANCE * first, (estimate.first_step_peak_bytes, first)
    # On the CPU there is no allocator model: the estimate is the exact tensor peak, and here it is exact.
    assert estimate.peak_bytes == estimate.tensor_peak_bytes == steady
    assert estimate.first_step_peak_bytes == first
    assert sum(estimate.breakdown.values()) == estimate.peak_bytes


def test_checkpointing_and_the_fused_loss_lower_the_estimate() -> None:
    base = StepSettings(batch_size=4, seq_length=512, target="cpu")  # activations dominate at this size
    plain, full, fused = (estimate_memory("tiny-llama", base, **change) for change in
                          ({}, {"policy": "full"}, {"policy": "full", "loss": "fused"}))
    assert plain.peak_bytes > full.peak_bytes > fused.peak_bytes
    # full checkpointing keeps the block inputs only; the fused loss also drops the saved fp32 log-softmax
    assert plain.breakdown["activations"] > 2 * full.breakdown["activations"] > 4 * fused.breakdown["activations"]


@pytest.mark.parametrize(("policy", "loss"), [("full", "MaskedCrossEntropy"), ("none", "FusedLinearCrossEntropy")])
def test_estimate_of_a_recipe_matches_its_tracked_training_steps(tmp_path: Any, policy: str, loss: str) -> None:
    """`remat finetune`'s own `mem` figure (tracked, step 2: the optimizer state exists) against the estimate of the
    same recipe. The recipe trains on the builtin corpus, whose packed rows restart ``position_ids`` at document
    boundaries (transformers then builds a mask the simulated batch does not need): hence 3%, not equality."""
    from remat.estimate.api import settings_from_recipe
    from remat.recipes.finetune import FinetuneRecipe
    from remat.recipes.loader import validate_recipe

    cfg = validate_recipe({
        "output_dir": str(tmp_path),
        "model": {"preset": "tiny-llama", "config": {"num_hidden_layers": 2},
                  "output_hidden_states": loss.startswith("Fused")},
        "dataset": {"seq_length": 64},
        "step_scheduler": {"global_batch_size": 4, "local_batch_size": 2, "max_steps": 2},
        "loss_fn": {"_target_": f"remat.loss.{loss}"},
        "distributed": {"activation_checkpointing": policy},
        "checkpoint": {"enabled": False},
        "logging": {"memory": "tracked", "progress": "plain", "metrics_file": None},
    })
    model, settings = settings_from_recipe(cfg, target="cpu")
    estimate = estimate_memory(model, settings)
    measured = FinetuneRecipe(cfg).run().records[-1].mem_bytes
    assert abs(estimate.peak_bytes - measured) <= TOLERANCE * measured, (estimate.peak_bytes, measured)


def _bench_cuda_module() -> Any:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_estimate_cuda.py"
    spec = importlib.util.spec_from_file_location("bench_estimate_cuda", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cuda_benchmark_runs_the_same_step_and_matches_on_the_cpu() -> None:
    """benchmarks/bench_estimate_cuda.py measures on a GPU; its --check-on-cpu mode runs the same code on the CPU
    against a CPU estimate, where every row must match exactly."""
    bench = _bench_cuda_module()
    assert bench.main(["--check-on-cpu", "--preset", "tiny-llama", "--batch-size", "2", "--seq-length", "32",
                       "--dtype", "float32", "--autocast", "bfloat16", "--policies", "none,selective",
                       "--losses", "fused"]) == 0


def test_cuda_benchmark_refuses_to_run_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would measure")
    assert _bench_cuda_module().main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.slow
def test_the_seed_recipe_estimate_runs_and_is_in_range(capsys: pytest.CaptureFixture[str]) -> None:
    """`remat estimate examples/llama_3_2_1b_seed.yaml`: Llama-3.2-1B, FSDP2 over 8 ranks, full checkpointing and the
    fused loss (the published 7.30 GiB row; docs/estimate.md explains the gap)."""
    from pathlib import Path

    from remat.cli import main

    recipe = Path(__file__).resolve().parents[2] / "examples" / "llama_3_2_1b_seed.yaml"
    assert main(["estimate", str(recipe), "--fits", "80GiB"]) == 0
    printed = capsys.readouterr().out
    peak_line = next(line for line in printed.splitlines() if line.startswith("peak "))
    assert 4.5 < float(peak_line.split()[1]) < 8.0  # GiB
    assert "fits 80.00 GiB: yes" in printed and "flash x32" in printed  # 16 layers, recomputed once
