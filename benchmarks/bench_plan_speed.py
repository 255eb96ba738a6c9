"""How long planning takes against one estimate of the same recipe (issue #21's target: `remat plan` with four budgets
in at most 3x the CPU time of one `remat estimate`; one estimate of the seed recipe in at most 11.7 s of CPU).

Runs, as subprocesses with one intra-op thread, in turn (``--rounds`` times, medians reported):

- ``remat estimate examples/llama_3_2_1b_seed.yaml`` (one setting);
- ``remat plan examples/llama_3_2_1b_seed.yaml --budget 80GiB --budget 40GiB --budget 20GiB --budget 12GiB``;
- ``python -c "import remat.planner.api, remat.estimate.api"``: the imports both pay, so the ratio is also given
  without them.

CPU time is user + system of the child (``RUSAGE_CHILDREN``), which a busy machine changes less than wall time.
Writes benchmarks/results/plan_speed.{json,md}.

    .venv/bin/python benchmarks/bench_plan_speed.py [--rounds 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RECIPE = "examples/llama_3_2_1b_seed.yaml"
BUDGETS = ("80GiB", "40GiB", "20GiB", "12GiB")
FLOAT32 = ("--model.dtype", "float32")
BUDGETS_FLOAT32 = ("80GiB", "40GiB", "24GiB", "16GiB")  # the same shares of the float32 step's range
COMMANDS: dict[str, list[str]] = {
    "imports": [sys.executable, "-c", "import remat.planner.api, remat.estimate.api, remat.cli"],
    "estimate": [sys.executable, "-m", "remat.cli", "estimate", RECIPE],
    "plan (4 budgets)": [sys.executable, "-m", "remat.cli", "plan", RECIPE,
                         *(arg for budget in BUDGETS for arg in ("--budget", budget))],
    # float32: its per-block mixes are composed from the uniform policies' traces (docs/planner.md)
    "estimate, float32": [sys.executable, "-m", "remat.cli", "estimate", RECIPE, *FLOAT32],
    "plan (4 budgets), float32": [sys.executable, "-m", "remat.cli", "plan", RECIPE, *FLOAT32,
                                  *(arg for budget in BUDGETS_FLOAT32 for arg in ("--budget", budget))],
}
TARGET_RATIO = 3.0
TARGET_ESTIMATE_CPU_S = 11.7


def run_once(command: list[str]) -> dict[str, float]:
    """Wall and CPU seconds of one run of ``command`` (fails loudly when it fails)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu}


def median(values: list[float]) -> float:
    return statistics.median(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in COMMANDS}
    load_before = os.getloadavg()[0]
    for round_ in range(1, args.rounds + 1):
        for name, command in COMMANDS.items():  # in turn, so drift falls on every command alike
            runs[name].append(run_once(command))
            print(f"round {round_}/{args.rounds} {name}: {runs[name][-1]['cpu_s']:.1f} s CPU", flush=True)
    cpu = {name: median([r["cpu_s"] for r in rs]) for name, rs in runs.items()}
    wall = {name: median([r["wall_s"] for r in rs]) for name, rs in runs.items()}
    ratio = cpu["plan (4 budgets)"] / cpu["estimate"]
    ratio_without_imports = (cpu["plan (4 budgets)"] - cpu["imports"]) / (cpu["estimate"] - cpu["imports"])
    ratio_float32 = cpu["plan (4 budgets), float32"] / cpu["estimate, float32"]
    import torch

    result: dict[str, Any] = {
        "recipe": RECIPE, "budgets": list(BUDGETS), "rounds": args.rounds, "median_cpu_s": cpu, "median_wall_s": wall,
        "runs": runs, "plan_over_estimate_cpu": round(ratio, 2),
        "plan_over_estimate_cpu_without_imports": round(ratio_without_imports, 2),
        "plan_over_estimate_cpu_float32": round(ratio_float32, 2), "budgets_float32": list(BUDGETS_FLOAT32),
        "targets": {"plan_over_estimate_cpu": TARGET_RATIO, "estimate_cpu_s": TARGET_ESTIMATE_CPU_S},
        "machine": {"cpus": os.cpu_count(), "load_average_1min_before": load_before, "python": platform.python_version(),
                    "torch": torch.__version__, "threads": 1},
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Planning time against one estimate (the seed recipe)", "",
        f"{result['date']}; {os.cpu_count()} CPUs, one torch thread, load average {load_before:.1f} before; torch "
        f"{torch.__version__}, Python {platform.python_version()}; medians of {args.rounds} rounds run in turn. "
        "Produced by benchmarks/bench_plan_speed.py.", "",
        "| command | CPU s | wall s |", "| --- | ---: | ---: |",
        *(f"| `{name}` | {cpu[name]:.1f} | {wall[name]:.1f} |" for name in COMMANDS), "",
        f"- plan (4 budgets) / estimate, CPU: **{ratio:.2f}x** (target <= {TARGET_RATIO:g}x); without the imports "
        f"both pay: {ratio_without_imports:.2f}x. One whole step and four stopped before the update are simulated "
        "(the uniform policies); every other candidate is composed from their block segments (docs/planner.md).",
        f"- the same recipe in float32 (budgets {', '.join(BUDGETS_FLOAT32)}): plan / estimate, CPU: "
        f"**{ratio_float32:.2f}x**.",
        f"- one estimate: **{cpu['estimate']:.1f} s** of CPU (target <= {TARGET_ESTIMATE_CPU_S} s).", "",
    ]
    (out / "plan_speed.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
