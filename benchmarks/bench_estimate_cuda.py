"""On a CUDA GPU: ``torch.cuda.max_memory_allocated`` of a training step against `remat.estimate_memory`.

For each setting (activation checkpointing none / selective / full, each with the plain and the fused loss), the
estimate is made first (``target="cuda"``, on fake tensors), then the same step runs on the GPU, built and run by the
very functions the recipe and the simulation use (`remat.recipes.build`, `remat.recipes.step.train_step`, and the
simulation's ``make_batch``), so all three run the same code:

1. build the model on the GPU, wrap it, build the optimizer;
2. step 1 (creates the optimizer state, warms up cuBLAS);
3. ``torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()``; step 2; ``torch.cuda.max_memory_allocated()``.

The estimate's ``peak_bytes`` is what step 2 should measure. What it does not model shows up as the difference:
library workspaces (cuBLAS/cuBLASLt, allocated through the caching allocator during step 1 and kept), cuDNN attention
if PyTorch picks it, several streams. One process, one GPU (``strategy=single``); FSDP2 needs torchrun and is not
measured here.

Without a CUDA device the script says so and exits with status 2, measuring nothing. ``--check-on-cpu`` runs the
same code on the CPU instead, with the exact live-tensor tracker in place of the CUDA statistics and a CPU estimate
(``target="cpu"``): the errors must then be zero, which is what the test suite checks.

    python benchmarks/bench_estimate_cuda.py                                    # llama-3.2-1b, 2 x 2048, bf16
    python benchmarks/bench_estimate_cuda.py --preset llama-20m --batch-size 8 --seq-length 1024 --dtype float32 \\
        --autocast bfloat16 --out benchmarks/results
    python benchmarks/bench_estimate_cuda.py --batch-size 1 --seq-length 131072 --losses fused \\
        --policies 'full,{mode: full, offload: true}'                        # offload: host copies are not device memory
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import platform
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from remat.distributed import DistributedSetup
from remat.estimate.api import estimate_memory, resolve_model
from remat.estimate.settings import StepSettings
from remat.estimate.simulate import make_batch
from remat.memory import LiveTensorTracker
from remat.recipes.build import build_optimizer, build_recipe_model, build_training_module
from remat.recipes.config import CompileConfig
from remat.recipes.step import step_label_tokens, train_step

GIB = 2**30
POLICIES = ("none", "selective", "full")
LOSSES = ("plain", "fused")


class RealStep(NamedTuple):
    """The pieces of one training step built on a real device by the recipe's own build (``remat.recipes.build``)."""

    net: torch.nn.Module
    root: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    plan: str | None
    """The checkpointing plan's summary (None when nothing is checkpointed)."""
    run: Callable[[], Any]
    """One fwd + bwd + clip + optimizer step: the recipe's own ``remat.recipes.step.train_step``."""


def build_step(model_name: str, settings: StepSettings, device: torch.device,
               compile: CompileConfig | None = None) -> RealStep:
    """Model (seeded weights), checkpointing and loss module, optimizer and batch of ``settings`` on ``device``;
    ``compile``: the recipe's ``compile`` section (each decoder block compiled after checkpointing wraps it)."""
    recipe = settings.to_recipe(resolve_model(model_name))
    if compile is not None:
        recipe = recipe.model_copy(update={"compile": compile})
    torch.manual_seed(0)
    d = recipe.distributed  # single, or a torchrun worker's layout (bench_context_parallel.py)
    setup = DistributedSetup.build(strategy=d.strategy, activation_checkpointing=d.activation_checkpointing,
                                   dp_size=d.dp_size, cp_size=d.cp_size, device=device)
    net = build_recipe_model(recipe, vocab_size=settings.vocab_size, device=str(device))
    root = build_training_module(net, recipe, setup)
    params = list(net.parameters())
    optimizer = build_optimizer(recipe, [p for p in params if p.requires_grad])
    batch = make_batch(recipe, settings.run(), net.config.get_text_config().vocab_size)
    batches = [{k: v.to(device) for k, v in batch.items()}] * settings.grad_accumulation
    label_tokens = step_label_tokens(batches, setup)
    run = functools.partial(train_step, root, params, optimizer, batches, setup=setup, label_tokens=label_tokens,
                            autocast_dtype=recipe.model.autocast, max_norm=recipe.clip_grad_norm.max_norm)
    plan = setup.plan.summary() if setup.plan is not None and setup.plan.layers else None
    return RealStep(net, root, optimizer, params, plan, run)


def measure(model_name: str, settings: StepSettings, device: torch.device) -> dict[str, int]:
    """Run two steps of ``settings`` on ``device``; the figures of the second one (CUDA statistics on a GPU, the
    exact tracked peak on the CPU)."""
    step = build_step(model_name, settings, device)
    root, optimizer, params, training_step = step.root, step.optimizer, step.params, step.run
    training_step()
    if device.type == "cpu":
        with LiveTensorTracker(module=root, optimizer=optimizer) as tracker:
            before = tracker.current_bytes
            training_step()
        return {"max_memory_allocated": tracker.peak_bytes, "allocated_before_step": before,
                "max_memory_reserved": 0}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    training_step()
    torch.cuda.synchronize()
    figures = {"max_memory_allocated": torch.cuda.max_memory_allocated(), "allocated_before_step": before,
               "max_memory_reserved": torch.cuda.max_memory_reserved()}
    del step, training_step, root, params, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return figures


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device("cpu" if args.check_on_cpu else "cuda")
    base = StepSettings(batch_size=args.batch_size, seq_length=args.seq_length, dtype=args.dtype,
                        autocast=None if args.autocast == "none" else args.autocast, target=device.type)
    rows = []
    for policy in parse_policies(args.policies):
        for loss in args.losses.split(","):
            settings = dataclasses.replace(base, policy=policy, loss=loss)
            start = time.perf_counter()
            estimate = estimate_memory(args.preset, settings)
            estimate_seconds = time.perf_counter() - start
            measured = measure(args.preset, settings, device)
            peak = measured["max_memory_allocated"]
            rows.append({
                "setting": settings.describe(),
                "estimate_bytes": estimate.peak_bytes,
                "estimate_host_bytes": estimate.host_peak_bytes,
                "estimate_tensor_bytes": estimate.tensor_peak_bytes,
                "estimate_start_bytes": estimate.phase_peaks.get("start", 0),
                "estimate_phase": estimate.phase,
                "estimate_seconds": round(estimate_seconds, 2),
                **measured,
                "error_percent": round(100 * (estimate.peak_bytes - peak) / peak, 2),
            })
            print(f"{settings.describe():>28}  estimate {estimate.peak_bytes / GIB:7.2f} GiB  measured "
                  f"{peak / GIB:7.2f} GiB  ({rows[-1]['error_percent']:+.1f}%)", flush=True)
    return rows


def parse_policies(text: str) -> list[Any]:
    """``--policies``: names and YAML mappings, comma-separated (``none,full,{mode: full, offload: true}``)."""
    import yaml

    return list(yaml.safe_load(f"[{text}]"))


def write(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    device = torch.cuda.get_device_name()
    meta = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
            "preset": args.preset, "batch_size": args.batch_size, "seq_length": args.seq_length,
            "dtype": args.dtype, "autocast": args.autocast, "date": time.strftime("%Y-%m-%d")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slug = device.lower().replace(" ", "_")
    (out / f"estimate_cuda_{slug}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# remat estimate vs torch.cuda.max_memory_allocated on {device}", "",
             f"{args.preset}, batch {args.batch_size} x {args.seq_length}, dtype {args.dtype}, autocast "
             f"{args.autocast}, AdamW, one GPU; torch {torch.__version__}, {meta['date']}. Step 2 (the optimizer "
             "state exists) is measured; see benchmarks/bench_estimate_cuda.py.", "",
             "| setting | estimate GiB | measured GiB | error | held before the step (measured) GiB |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['setting']} | {r['estimate_bytes'] / GIB:.2f} | {r['max_memory_allocated'] / GIB:.2f} | "
              f"{r['error_percent']:+.1f}% | {r['allocated_before_step'] / GIB:.2f} |" for r in rows]
    (out / f"estimate_cuda_{slug}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / f'estimate_cuda_{slug}.md'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--autocast", default="none", choices=("none", "bfloat16"))
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated checkpointing policies")
    parser.add_argument("--losses", default=",".join(LOSSES), help="comma-separated losses (plain, fused)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--check-on-cpu", action="store_true",
                        help="run the same code on the CPU against a CPU estimate (prints, writes nothing)")
    args = parser.parse_args(argv)
    if args.check_on_cpu:
        rows = run(args)
        return 0 if all(row["error_percent"] == 0 for row in rows) else 1
    if not torch.cuda.is_available():
        print("bench_estimate_cuda: no CUDA device here (torch.cuda.is_available() is False); this benchmark "
              "measures torch.cuda.max_memory_allocated on a GPU and has nothing to measure. Nothing was run.",
              file=sys.stderr)
        return 2
    write(run(args), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
