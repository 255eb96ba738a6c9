"""The seed's Llama-3.2-1B memory table, estimated by remat, and how long `remat estimate` takes for it.

The published table (H100-80GB, local batch 8 x 2048, AdamW, PyTorch 2.8, ``torch.cuda.max_memory_allocated``
averaged over the data-parallel ranks) has cumulative rows: baseline, + FSDP (dp 8), + activation checkpointing,
+ LC-CE (the fused loss); its last row ("all three") repeats the one before. This script estimates those four
settings under two readings of the seed's precision (docs/estimate.md explains why the first one fits):

- ``bf16``: bfloat16 parameters (a bf16 checkpoint loaded as is), so gradients and AdamW state are bf16 too;
  the baseline is one process without FSDP;
- ``fp32+mp``: float32 parameters and AdamW state, FSDP2 gathering them in bfloat16 (``MixedPrecisionPolicy``);
  the baseline is FSDP2 over one rank.

Then it runs ``remat estimate examples/llama_3_2_1b_seed.yaml --compare --setting <the baseline>`` (7 rows) as a
subprocess and records its wall and CPU time. Results go to benchmarks/results/estimate_seed.{json,md}.

    .venv/bin/python benchmarks/bench_estimate.py
    .venv/bin/python benchmarks/bench_estimate.py --out /tmp/estimate --skip-cli
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from remat.estimate.api import estimate_memory
from remat.estimate.settings import StepSettings

GIB = 2**30
SEED_GIB = {"baseline": 53.03, "+ FSDP (dp 8)": 47.59, "+ checkpointing": 33.06, "+ LC-CE (= all three)": 7.30}
ROWS: dict[str, dict[str, Any]] = {
    "baseline": {"policy": "none", "loss": "plain"},
    "+ FSDP (dp 8)": {"policy": "none", "loss": "plain", "strategy": "fsdp2", "world_size": 8},
    "+ checkpointing": {"policy": "full", "loss": "plain", "strategy": "fsdp2", "world_size": 8},
    "+ LC-CE (= all three)": {"policy": "full", "loss": "fused", "strategy": "fsdp2", "world_size": 8},
}
READINGS: dict[str, dict[str, Any]] = {
    "bf16": {"dtype": "bfloat16"},
    "fp32+mp": {"dtype": "float32", "mixed_precision": "bfloat16", "strategy": "fsdp2", "world_size": 1},
}
CLI = ["examples/llama_3_2_1b_seed.yaml", "--compare", "--fits", "80GiB",
       "--setting", "strategy=single,world_size=1,policy=none,loss=plain"]


def estimate_rows() -> list[dict[str, Any]]:
    rows = []
    for reading, precision in READINGS.items():
        for name, row in ROWS.items():
            options = {**precision, **row}
            wall, cpu = time.perf_counter(), time.process_time()
            estimate = estimate_memory("llama-3.2-1b", StepSettings(batch_size=8, seq_length=2048), **options)
            rows.append({
                "reading": reading, "row": name, "seed_gib": SEED_GIB[name],
                "estimate_gib": round(estimate.peak_bytes / GIB, 2),
                "estimate_gb": round(estimate.peak_bytes / 1e9, 2),
                "difference_gib": round(estimate.peak_bytes / GIB - SEED_GIB[name], 2),
                "phase": estimate.phase,
                "breakdown_gib": {k: round(v / GIB, 2) for k, v in estimate.breakdown.items() if v},
                "seconds": round(time.perf_counter() - wall, 1), "cpu_seconds": round(time.process_time() - cpu, 1),
            })
            print(f"{reading:8} {name:24} estimate {rows[-1]['estimate_gib']:6.2f} GiB   seed {SEED_GIB[name]:6.2f}"
                  f"   ({rows[-1]['seconds']} s)", flush=True)
    return rows


def time_cli() -> dict[str, Any]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "remat.cli", "estimate", *CLI], capture_output=True, text=True,
                          check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(done.stdout)
    return {"command": "remat estimate " + " ".join(CLI), "wall_seconds": round(wall, 1),
            "cpu_seconds": round(cpu, 1), "output": done.stdout}


def write(rows: list[dict[str, Any]], cli: dict[str, Any] | None, out: Path) -> None:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    meta = {"cpu_count": os.cpu_count(), "load_average_1min": load, "torch": torch.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "estimate_seed.json").write_text(json.dumps({"meta": meta, "rows": rows, "cli": cli}, indent=2) + "\n")
    lines = ["# The seed's Llama-3.2-1B table, estimated by remat", "",
             f"Batch 8 x 2048, AdamW, modelled for CUDA; {meta['cpu_count']} CPUs, load average "
             f"{load:.1f}, torch {meta['torch']}, {meta['date']}. Produced by benchmarks/bench_estimate.py; "
             "docs/estimate.md discusses the differences.", "",
             "| precision reading | row | seed (GiB) | remat (GiB) | remat - seed | peak phase | estimate time |",
             "| --- | --- | ---: | ---: | ---: | --- | ---: |"]
    lines += [f"| {r['reading']} | {r['row']} | {r['seed_gib']:.2f} | {r['estimate_gib']:.2f} | "
              f"{r['difference_gib']:+.2f} | {r['phase']} | {r['seconds']} s ({r['cpu_seconds']} s CPU) |"
              for r in rows]
    if cli is not None:
        lines += ["", f"`{cli['command']}`: {cli['wall_seconds']} s wall, {cli['cpu_seconds']} s CPU.", "", "```",
                  cli["output"].rstrip(), "```"]
    (out / "estimate_seed.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'estimate_seed.md'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--skip-cli", action="store_true", help="do not time the remat estimate command")
    args = parser.parse_args(argv)
    rows = estimate_rows()
    write(rows, None if args.skip_cli else time_cli(), Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
