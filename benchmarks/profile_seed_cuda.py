"""On one CUDA GPU: `remat profile` at the seed shape (Llama-3.2-1B, batch 8 x 2048, bf16, AdamW, fused loss: one
rank of examples/llama_3_2_1b_seed.yaml), ``auto`` at budgets of 15/20/25/30 GiB against the uniform policies.

Issue #10 asks that ``auto`` be no slower than the fastest uniform policy that fits each budget. This script runs

    remat profile examples/llama_3_2_1b_seed.yaml \\
        --policies 'none,attention,mlp,selective,full,{mode: full, every_n_layers: 2},auto' \\
        --budget 15GiB --budget 20GiB --budget 25GiB --budget 30GiB --steps 8 --warmup 2 \\
        --distributed.strategy single --distributed.dp_size null --distributed.device cuda \\
        --step_scheduler.global_batch_size 8 --json ... --png ... --write-calibration ...

in this process, then writes under ``--out`` (default benchmarks/results/), each name carrying the GPU and torch
version: the profile's JSON and PNG, the calibration it fits, and a Markdown summary with the side-by-side table and,
per budget, auto's median step time against the fastest uniform policy whose measured peak fits that budget.

    python benchmarks/profile_seed_cuda.py                  # the acceptance run, ~3-5 minutes on an H100
    python benchmarks/profile_seed_cuda.py --dry-run        # print the remat profile command, run nothing

Without a CUDA device it says so and exits with status 2 (``--dry-run`` works anywhere).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "llama_3_2_1b_seed.yaml"
BUDGETS = ("15GiB", "20GiB", "25GiB", "30GiB")
UNIFORM = ("none", "attention", "mlp", "selective", "full", "{mode: full, every_n_layers: 2}")
#: How `remat profile` labels them (a mapping by its description).
UNIFORM_LABELS = ("none", "attention", "mlp", "selective", "full", "full, every 2nd block")
#: One rank of the seed recipe (FSDP2 over 8 GPUs, local batch 8): the same micro-batch on one GPU, unsharded.
ONE_RANK = ("--distributed.strategy", "single", "--distributed.dp_size", "null", "--distributed.device", "cuda",
            "--step_scheduler.global_batch_size", "8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(RECIPE), help="the recipe (default: the seed recipe)")
    parser.add_argument("--budget", action="append", metavar="SIZE",
                        help=f"a budget for auto; repeat it (default: {', '.join(BUDGETS)})")
    parser.add_argument("--steps", type=int, default=8, help="steps per setting, warm-up included (default 8)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps left out of medians (default 2)")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="auto counts as no slower when within this share of the fastest fitting uniform "
                             "policy's median (step-time noise; default 0.02)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the results")
    parser.add_argument("--dry-run", action="store_true", help="print the remat profile command and exit")
    args, extra = parser.parse_known_args(argv)
    args.overrides = extra
    if args.steps <= args.warmup or args.warmup < 1:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}), which must be >= 1")
    if not 0 <= args.tolerance < 1:
        parser.error(f"--tolerance: got {args.tolerance}; allowed: 0 <= tolerance < 1")
    return args


def result_stem(device: str, torch_version: str) -> str:
    """``profile_seed_<device>_torch<version>``, anything but letters, digits, ``._-`` turned into dashes."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", f"profile_seed_{device}_torch{torch_version}").strip("-")


def profile_argv(args: argparse.Namespace, stem: Path) -> list[str]:
    """The `remat profile` arguments of the acceptance run, writing ``stem``.json / .png / _calibration.json."""
    budgets = args.budget or list(BUDGETS)
    argv = ["profile", args.recipe, "--policies", ",".join([*UNIFORM, "auto"]), "--steps", str(args.steps),
            "--warmup", str(args.warmup)]
    for budget in budgets:
        argv += ["--budget", budget]
    argv += ["--json", f"{stem}.json", "--png", f"{stem}.png", "--write-calibration", f"{stem}_calibration.json"]
    return [*argv, *ONE_RANK, *args.overrides]


def verdicts(report: dict[str, Any], tolerance: float) -> list[dict[str, Any]]:
    """Per auto setting: its median step time, the fastest uniform policy whose measured peak fits its budget, the
    ratio, and whether auto is no slower (within ``tolerance``)."""
    settings = [s for s in report["settings"] if "median_step_s" in s]
    uniform = [s for s in settings if s["label"] in UNIFORM_LABELS]
    out = []
    for auto in (s for s in settings if "plan" in s):
        budget = auto["plan"]["budget_bytes"]
        fitting = [s for s in uniform if s["peak_bytes"] <= budget]
        fastest = min(fitting, key=lambda s: s["median_step_s"]) if fitting else None
        ratio = auto["median_step_s"] / fastest["median_step_s"] if fastest else None
        out.append({"setting": auto["label"], "budget_gib": auto["plan"]["budget_gib"],
                    "auto_peak_gib": auto["peak_gib"], "auto_within_budget": auto["peak_bytes"] <= budget,
                    "auto_step_s": auto["median_step_s"], "fastest_fitting_uniform": fastest and fastest["label"],
                    "uniform_step_s": fastest and fastest["median_step_s"], "ratio": ratio,
                    "no_slower": ratio is not None and ratio <= 1 + tolerance})
    return out


def markdown(report: dict[str, Any], checks: list[dict[str, Any]], command: str, tolerance: float) -> str:
    """The summary committed beside the JSON."""
    lines = [f"# remat profile at the seed shape on {report['device']} (torch {report['torch_version']})", "",
             f"`{command}`", "",
             f"{report['steps']} steps per setting; medians and peaks over steps {report['warmup_steps'] + 1}-"
             f"{report['steps']}. Largest loss difference between settings: {report['loss_difference']}.", "",
             "| setting | policy | peak GiB | median step s | tokens/s | step TFLOP |", "|---|---|---|---|---|---|"]
    for s in report["settings"]:
        if "median_step_s" not in s:
            lines.append(f"| {s['label']} | {s.get('policy_text') or '-'} | - | - | - | - ({s.get('error', '')}) |")
            continue
        lines.append(f"| {s['label']} | {s['policy_text']} | {s['peak_gib']:.2f} | {s['median_step_s']:.4f} | "
                     f"{s['tokens_per_s']:.0f} | {s['step_flops'] / 1e12:.1f} |")
    lines += ["", f"auto against the fastest uniform policy whose measured peak fits the budget (no slower: within "
                  f"{100 * tolerance:.0f}%):", "",
              "| budget GiB | auto peak GiB | auto step s | fastest fitting uniform | its step s | ratio | no slower |",
              "|---|---|---|---|---|---|---|"]
    for c in checks:
        ratio = f"{c['ratio']:.3f}" if c["ratio"] is not None else "-"
        lines.append(f"| {c['budget_gib']:.0f} | {c['auto_peak_gib']:.2f} | {c['auto_step_s']:.4f} | "
                     f"{c['fastest_fitting_uniform'] or 'none fits'} | {c['uniform_step_s'] or '-'} | {ratio} | "
                     f"{'yes' if c['no_slower'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.dry_run:
        stem = out / result_stem("DEVICE", torch.__version__)
        print(shlex.join(["remat", *profile_argv(args, stem)]))
        return 0
    if not torch.cuda.is_available():
        print("profile_seed_cuda: no CUDA device here (torch.cuda.is_available() is False); this acceptance run "
              "needs one GPU. On the CPU, try `remat profile examples/quickstart.yaml` instead, or --dry-run to see "
              "the command.", file=sys.stderr)
        return 2
    from remat.cli import main as remat_main

    stem = out / result_stem(torch.cuda.get_device_name(), torch.__version__)
    argv_ = profile_argv(args, stem)
    code = remat_main(argv_)
    report_path = Path(f"{stem}.json")
    if not report_path.is_file():
        return code or 1
    report = json.loads(report_path.read_text())
    checks = verdicts(report, args.tolerance)
    report_path.with_suffix(".md").write_text(markdown(report, checks, shlex.join(["remat", *argv_]), args.tolerance))
    for check in checks:
        print(json.dumps(check))
    print(f"wrote {stem}.json, .md, .png and _calibration.json")
    return code if code else (0 if all(c["no_slower"] for c in checks) else 1)


if __name__ == "__main__":
    raise SystemExit(main())
