"""What relaxing a plan at run time buys on the CPU (`remat.adaptation.relax_watch`): a tiny Llama whose first plan is
``full`` (a conservative plan, as if planned for a smaller budget) under a budget 20% above its predicted
no-checkpointing peak, relaxing after a stable stretch; against a run given the relaxed plan from the start.

Reported: the step it relaxed at and the plans, the predicted recompute before and after (the planner's price), the
tracked peaks against the budget and against the run planned right from the start, whether the losses are equal,
and the median step time of the first and the relaxed plan, timed interleaved (one step of each in turn, so that
the load of a shared machine weighs on both alike). Results go to benchmarks/results/relax_cpu.{json,md}.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_relax.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_relax.py --steps 12 --relax-after 3 --out /tmp/relax
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from remat.checkpointing import CheckpointPolicy
from remat.adaptation.adapter import adapter_for_recipe
from remat.adaptation.relaxing import modes_of
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe
from remat.recipes.reports.reporting import StepRecord

MODEL = {"preset": "tiny-llama", "config": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 6,
                                            "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 4096}}


def recipe(out: Path, policy: Any, budget: int | str, steps: int, relax_after: int | None) -> dict[str, Any]:
    return {
        "seed": 7, "output_dir": str(out), "model": MODEL, "tokenizer": {"vocab_size": 4096},
        "dataset": {"seq_length": 256},
        "step_scheduler": {"global_batch_size": 4, "local_batch_size": 4, "max_steps": steps},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-3},
        "lr_scheduler": {"warmup_steps": 1, "decay": "constant"},
        "checkpoint": {"enabled": False},
        "logging": {"progress": "plain", "memory": "tracked", "metrics_file": None},
        "distributed": {"device": "cpu", "activation_checkpointing": {  # what auto planned: ``policy``
            "mode": "auto", "plan": policy, "memory_budget": budget, "relax_after_steps": relax_after}},
    }


def seconds_of(adapter: Any, policy: CheckpointPolicy) -> float:
    """The planner's predicted recompute seconds per step of ``policy``."""
    planner = adapter.planner
    modes = modes_of(policy, planner.measurements)
    assert modes is not None
    return planner.price("", policy, modes, adapter.budget_bytes).seconds(planner.flops_per_second,
                                                                          planner.host_bandwidth)


def interleaved_step_times(work: Path, policies: dict[str, Any], budget: int, rounds: int) -> dict[str, float]:
    """Median seconds of a training step under each policy, one step of each in turn for ``rounds`` rounds (the
    first round, warm-up, left out)."""
    jobs = {}
    for name, policy in policies.items():
        job = FinetuneRecipe(validate_recipe(recipe(work / f"timing-{name}", policy, budget, rounds, None)))
        job.setup()
        job.model.train()
        jobs[name] = job
    times: dict[str, list[float]] = {name: [] for name in jobs}
    try:
        for _ in range(rounds):
            for name, job in jobs.items():
                start = time.perf_counter()
                job._train_step()
                times[name].append(time.perf_counter() - start)
    finally:
        for job in jobs.values():
            job.release_run_locks()
    return {name: statistics.median(values[1:]) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--relax-after", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12, help="interleaved timing rounds")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    work = Path(tempfile.mkdtemp(prefix="bench-relax-"))
    probe = adapter_for_recipe(validate_recipe(recipe(work / "probe", "none", "1GiB", args.steps, None)))
    budget = int(probe.planner.estimate(CheckpointPolicy(mode="none")).peak_bytes * 1.2)

    cfg = validate_recipe(recipe(work / "relax", {"mode": "full"}, budget, args.steps, args.relax_after))
    adapter = adapter_for_recipe(cfg)
    plans: list[str] = []

    def plan_in_force(job: FinetuneRecipe, record: StepRecord) -> None:
        plans.append(job.dist.plan.policy.describe() if job.dist.plan is not None else "none")

    job = FinetuneRecipe(cfg, replanner=adapter, callbacks=[plan_in_force])
    relaxed_run = job.run()
    assert job.retry is not None
    relaxed = adapter.policy
    changed = next((i for i, plan in enumerate(plans) if plan != plans[0]), None)
    right = FinetuneRecipe(validate_recipe(recipe(work / "right", relaxed.to_dict(), budget, args.steps,
                                                  None))).run()

    relax_step = None if changed is None else changed + 1  # the step after which the plan changed
    timing = interleaved_step_times(work, {"first": {"mode": "full"}, "relaxed": relaxed.to_dict()}, budget,
                                    args.rounds)
    report = {
        "device": f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} thread(s)",
        "torch": torch.__version__, "load_average": [round(x, 2) for x in os.getloadavg()], "model": MODEL, "seq_length": 256, "batch": 4, "steps": args.steps,
        "relax_after_steps": args.relax_after, "budget_bytes": budget,
        "first_plan": CheckpointPolicy(mode="full").describe(), "relaxed_plan": relaxed.describe(),
        "relaxed_after_step": relax_step, "relaxes": job.retry.relax.relaxes, "replans": job.retry.replans,
        "predicted_recompute_s": {"before": seconds_of(adapter, CheckpointPolicy(mode="full")),
                                  "after": seconds_of(adapter, relaxed)},
        "peak_bytes": [r.mem_bytes for r in relaxed_run.records],
        "peak_bytes_planned_right_from_start": [r.mem_bytes for r in right.records],
        "interleaved_rounds": args.rounds,
        "median_step_s": {"first_plan": timing["first"], "relaxed_plan": timing["relaxed"]},
        "losses_equal": [(r.loss, r.grad_norm) for r in relaxed_run.records]
        == [(r.loss, r.grad_norm) for r in right.records],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "relax_cpu.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "relax_cpu.md").write_text(markdown(report))
    print(markdown(report))


def markdown(r: dict[str, Any]) -> str:
    mib = 2**20
    steps = r["median_step_s"]
    relaxed_from = r["relaxed_after_step"] or len(r["peak_bytes"])
    same_peaks = r["peak_bytes"][relaxed_from:] == r["peak_bytes_planned_right_from_start"][relaxed_from:]
    return "\n".join([
        "# Relaxing a plan at run time (CPU)", "",
        f"`OMP_NUM_THREADS=1 python benchmarks/bench_relax.py` on {r['device']}, torch {r['torch']}: a "
        f"{r['model']['config']['num_hidden_layers']}-layer tiny Llama (hidden {r['model']['config']['hidden_size']}),"
        f" batch {r['batch']} x {r['seq_length']} tokens, {r['steps']} steps, first plan `{r['first_plan']}` under a "
        f"budget of {r['budget_bytes'] / mib:.2f} MiB (20% above the predicted no-checkpointing peak), "
        f"`relax_after_steps: {r['relax_after_steps']}`.", "",
        "| | value |", "| --- | --- |",
        f"| relaxed after step | {r['relaxed_after_step']} ({r['relaxes']} relax, {r['replans']} re-plans) |",
        f"| plans | `{r['first_plan']}` -> `{r['relaxed_plan']}` |",
        f"| predicted recompute a step | {r['predicted_recompute_s']['before']:.4f} s -> "
        f"{r['predicted_recompute_s']['after']:.4f} s |",
        f"| tracked peaks, steps 1-{relaxed_from} | "
        f"{', '.join(f'{p / mib:.2f}' for p in r['peak_bytes'][:relaxed_from])} MiB |",
        f"| tracked peaks after the relax | {', '.join(f'{p / mib:.2f}' for p in r['peak_bytes'][relaxed_from:])} MiB"
        f" of {r['budget_bytes'] / mib:.2f} MiB (the same as the run planned right from the start: {same_peaks}) |",
        f"| median step, first plan (interleaved, {r['interleaved_rounds']} rounds) | "
        f"{steps['first_plan']:.3f} s |",
        f"| median step, relaxed plan (interleaved) | {steps['relaxed_plan']:.3f} s "
        f"(first / relaxed: {steps['first_plan'] / steps['relaxed_plan']:.2f}) |",
        f"| losses and gradient norms equal to that run | {r['losses_equal']} |", "",
        f"Load average during the run (1, 5, 15 min): {', '.join(map(str, r['load_average']))} on "
        f"{os.cpu_count()} cores; CPU step times drift about 10% between runs on a shared machine: read the ratio of "
        "the interleaved medians. The recompute is priced at the planner's default CPU throughput (5e10 FLOP/s), "
        "not calibrated.",
        "",
    ])


if __name__ == "__main__":
    main()
