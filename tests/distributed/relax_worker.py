"""What each torchrun worker of `test_replan_ranks.py::test_every_rank_relaxes_to_the_same_plan_at_the_same_step`
runs: ``python relax_worker.py OUT_DIR STRATEGIES``.

Per strategy (ddp, fsdp2), 4 steps of the tiny Llama of replan_worker.py whose first plan is ``full`` under a budget
20% above the predicted no-checkpointing peak (a conservative first plan, as if planned for a smaller budget),
relaxing after 2 stable steps: every rank must see the same stretch (the peak is agreed over the ranks), relax at
step 3 to the same plan (rank 0 plans in a child process and broadcasts it), and train the same losses and gradient
norms as a run given that plan from the start. Each rank writes ``relax_rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_recipes import leave_process_group
from replan_worker import outcomes, recipe

from remat.checkpointing import CheckpointPolicy
from remat.adaptation.adapter import adapter_for_recipe
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe


def budget_for(out: Path, strategy: str) -> int:
    """20% over the predicted no-checkpointing peak. Before any process group: the fsdp2 estimate needs its own."""
    planner = adapter_for_recipe(validate_recipe(recipe(out / "probe", strategy, "1GiB")), world_size=2).planner
    return int(planner.estimate(CheckpointPolicy(mode="none")).peak_bytes * 1.2)


def relaxing(out: Path, strategy: str, budget: int, policy: Any, relax_after_steps: int | None) -> dict[str, Any]:
    data = recipe(out, strategy, budget)
    data["step_scheduler"]["max_steps"] = 4
    data["distributed"]["activation_checkpointing"].update(plan=policy, relax_after_steps=relax_after_steps)
    return data


def one_strategy(out: Path, strategy: str, budget: int) -> dict[str, Any]:
    cfg = validate_recipe(relaxing(out / "relax", strategy, budget, "full", 2))
    adapter = adapter_for_recipe(cfg, world_size=2)  # as `remat finetune` makes it: plans in a child process
    plans: list[Any] = []

    def plan_in_force(job: FinetuneRecipe, record: Any) -> None:
        plans.append(job.dist.plan.policy.to_dict() if job.dist.plan is not None else None)

    job = FinetuneRecipe(cfg, replanner=adapter, callbacks=[plan_in_force])
    result = job.run()
    assert job.retry is not None
    reference = FinetuneRecipe(validate_recipe(relaxing(out / "reference", strategy, budget,
                                                        adapter.policy.to_dict(), None))).run()
    return {"relaxed": outcomes(result), "reference": outcomes(reference), "relaxes": job.retry.relax.relaxes,
            "replans": job.retry.replans, "policy": adapter.policy.to_dict(), "plans": plans, "budget": budget,
            "mem": [r.mem_bytes for r in result.records]}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    strategies = sys.argv[2].split(",")
    budgets = {strategy: budget_for(out / strategy, strategy) for strategy in strategies}
    report = {strategy: one_strategy(out / strategy, strategy, budgets[strategy]) for strategy in strategies}
    (out / f"relax_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main()
