"""Context parallelism at growing lengths: tokens/s and the peak per rank of one row cut over every process.

A torchrun worker (one process per GPU; torchrun, not this script, starts the processes)::

    torchrun --nproc-per-node 8 benchmarks/bench_context_parallel.py                  # llama-3.2-1b, 256k-2M tokens
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --lengths 65536,131072
    torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --check-on-cpu   # tiny model, gloo (the tests)

Each length is one row of batch 1 over ``cp_size`` = the number of processes (FSDP2 over them, dp 1), with the
long-context setting (full checkpointing, tiled blocks, the fused loss) through the recipe's own build and step
(``bench_estimate_cuda.build_step``). Per length: one warm-up step, one step between ``reset_peak_memory_stats`` and
``max_memory_allocated`` (the maximum over the ranks; the live-tensor tracker's peak on the CPU), then ``--steps``
timed steps (median). A length that runs out of memory is recorded as such on every rank and ends the sweep; a
length whose step would overrun ``--budget-seconds`` (the last step's time scaled by the square of the length ratio,
as attention's time grows) is skipped. Rank 0 writes ``benchmarks/results/context_parallel_<device>_x<N>.{md,json}``
naming the device, the process count, torch and transformers.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark modules, however this is started
from bench_estimate_cuda import build_step  # noqa: E402

from remat.estimate.settings import StepSettings  # noqa: E402
from remat.memory import LiveTensorTracker  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
POLICY: dict[str, Any] = {"mode": "full", "tiled": True, "tile_tokens": 2048}
LENGTHS = (262144, 524288, 1048576, 2097152)
GIB = 2**30


def measure(args: argparse.Namespace, length: int, device: torch.device, world: int) -> dict[str, Any]:
    """One length: warm-up, peak, timed steps (see the module docstring); every rank returns the same row."""
    row: dict[str, Any] = {"tokens": length, "tokens_per_rank": -(-length // world)}
    policy = {**POLICY, "tile_tokens": args.tile_tokens}
    settings = StepSettings(batch_size=1, seq_length=length, dtype=args.dtype, policy=policy, loss="fused",
                            strategy="fsdp2", world_size=world, cp_size=world, target=device.type)
    step = None
    try:
        step = build_step(args.preset, settings, device)
        step.run()
        peak = _peak(step, device)
        seconds = []
        for _ in range(args.steps):
            _sync(device)
            start = time.perf_counter()
            step.run()
            _sync(device)
            seconds.append(time.perf_counter() - start)
        peaks = [0] * world
        dist.all_gather_object(peaks, peak)
        median = statistics.median(seconds)
        row.update(peak_bytes=max(peaks), peak_bytes_per_rank=peaks, step_seconds=seconds, median_seconds=median,
                   tokens_per_second=length / median)
    except torch.cuda.OutOfMemoryError as err:
        row["error"] = f"OutOfMemoryError: {str(err).splitlines()[0][:200]}"
    finally:
        del step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    failed = [None] * world
    dist.all_gather_object(failed, row.get("error"))  # one rank out of memory ends the length on every rank
    if any(failed) and "error" not in row:
        row = {"tokens": length, "tokens_per_rank": row["tokens_per_rank"],
               "error": next(e for e in failed if e)}
    return row


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(step: Any, device: torch.device) -> int:
    """The peak of one step: ``max_memory_allocated`` on a GPU, the live-tensor tracker's on the CPU."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        step.run()
        _sync(device)
        return int(torch.cuda.max_memory_allocated(device))
    with LiveTensorTracker(module=step.root, optimizer=step.optimizer) as tracker:
        step.run()
        return int(tracker.peak_bytes)


def render(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Context parallelism: one row over {meta['processes']} ranks ({meta['device']})", "",
             f"{meta['preset']}, batch 1, {meta['dtype']}, full + tiled ({meta['tile_tokens']} tokens) + fused loss, "
             f"fsdp2 over dp 1 x cp {meta['processes']}; torch {meta['torch']}, transformers {meta['transformers']}, "
             f"{meta['date']}. Peak: the maximum over the ranks; tokens/s: the row's tokens over the median step.",
             "", "| tokens | per rank | peak GiB (max over ranks) | median step s | tokens/s |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['tokens']:,} | {row['tokens_per_rank']:,} | {row['error']} | | |")
        else:
            lines.append(f"| {row['tokens']:,} | {row['tokens_per_rank']:,} | {row['peak_bytes'] / GIB:.2f} | "
                         f"{row['median_seconds']:.3f} | {row['tokens_per_second']:,.0f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=None, help="model preset (default llama-3.2-1b; tiny-llama on the CPU)")
    parser.add_argument("--lengths", type=lambda text: [int(x) for x in text.split(",")], default=None,
                        help="comma-separated tokens per row (default 262144,524288,1048576,2097152; 512,1024 "
                             "with --check-on-cpu)")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                        help="parameter dtype (default bfloat16; float32 with --check-on-cpu)")
    parser.add_argument("--tile-tokens", type=int, default=None, help="tokens per tile (default 2048; 64 on the CPU)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per length (the median is reported)")
    parser.add_argument("--budget-seconds", type=float, default=480.0,
                        help="skip a length whose step would end after this many seconds (default 480)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--check-on-cpu", action="store_true", help="a tiny model on the CPU with gloo (the tests)")
    args = parser.parse_args(argv)
    cpu = args.check_on_cpu
    for name, gpu_default, cpu_default in (("preset", "llama-3.2-1b", "tiny-llama"), ("lengths", list(LENGTHS),
                                           [512, 1024]), ("dtype", "bfloat16", "float32"), ("tile_tokens", 2048, 64)):
        if getattr(args, name) is None:
            setattr(args, name, cpu_default if cpu else gpu_default)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        print("bench_context_parallel: start it with torchrun, one process per GPU (torchrun --nproc-per-node N "
              "benchmarks/bench_context_parallel.py); nothing was run", file=sys.stderr)
        return 2
    if not args.check_on_cpu and not torch.cuda.is_available():
        print("bench_context_parallel: no CUDA device here; --check-on-cpu runs the same code on the CPU (gloo). "
              "Nothing was run.", file=sys.stderr)
        return 2
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu") if args.check_on_cpu else torch.device("cuda", local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    import transformers

    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
            "processes": world, "torch": torch.__version__, "transformers": transformers.__version__,
            "preset": args.preset, "dtype": args.dtype, "tile_tokens": args.tile_tokens, "steps": args.steps,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    rows: list[dict[str, Any]] = []
    start, last = time.perf_counter(), None
    for length in args.lengths:
        left = args.budget_seconds - (time.perf_counter() - start)
        if last is not None and last[1] * (length / last[0]) ** 2 > left:
            rows.append({"tokens": length, "tokens_per_rank": -(-length // world),
                         "error": f"skipped: {left:.0f} s of the budget left"})
            continue
        row = measure(args, length, device, world)
        rows.append(row)
        if dist.get_rank() == 0:
            print(f"{length:,} tokens: " + (row.get("error") or f"peak {row['peak_bytes'] / GIB:.2f} GiB, "
                  f"{row['tokens_per_second']:,.0f} tokens/s"), file=sys.stderr, flush=True)
        if "error" in row:
            break
        last = (length, row["median_seconds"])
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() else "_" for c in meta["device"].lower()).strip("_")
        stem = args.out / f"context_parallel_{slug}_x{world}"
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
        stem.with_suffix(".md").write_text(render(rows, meta))
        print(f"wrote {stem.with_suffix('.md')} and {stem.with_suffix('.json')}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
