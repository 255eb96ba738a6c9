"""What each torchrun worker of `test_replan_ranks.py` runs: ``python replan_worker.py OUT_DIR``.

Per strategy (ddp, fsdp2), 3 steps of a tiny Llama planned ``auto`` for a budget just above its no-checkpointing
peak (so the first plan is ``none``), twice: a reference run, then a run in which rank 1 alone holds an extra
tensor during the second step's first attempt, pushing only its peak over the budget. Every rank must see the
overshoot (the peak is agreed over the ranks), re-plan to the same policy, swap it in and retry the step. Each rank
writes ``replan_rank<r>.json``: per strategy the losses and gradient norms of both runs, the re-plans and the policy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_recipes import TINY_MODEL, leave_process_group, shared_tiny_recipe

from remat.checkpointing import CheckpointPolicy
from remat.adaptation.adapter import adapter_for_recipe
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe


def recipe(out: Path, strategy: str, budget: int | str) -> dict[str, Any]:
    return shared_tiny_recipe(
        seed=5, output_dir=str(out), model=TINY_MODEL, dataset={"seq_length": 128, "max_samples": 20},
        step_scheduler={"global_batch_size": 8, "max_steps": 3}, lr_scheduler={"warmup_steps": 1, "decay": "constant"},
        checkpoint={"enabled": False}, logging={"memory": "tracked", "metrics_file": None},
        distributed={"strategy": strategy,  # what auto planned for the budget: none
                     "activation_checkpointing": {"mode": "auto", "plan": "none", "memory_budget": budget}})


def outcomes(result: Any) -> list[list[float]]:
    return [[r.loss, r.grad_norm] for r in result.records]


def budget_and_extra(out: Path, strategy: str) -> tuple[int, int]:
    """A budget just above the predicted no-checkpointing peak, and rank 1's overshoot (the corrected plan still
    fits between full and none). Before any process group: the fsdp2 estimate needs one of its own."""
    planner = adapter_for_recipe(validate_recipe(recipe(out / "probe", strategy, "1GiB")), world_size=2).planner
    none, full = (planner.estimate(CheckpointPolicy(mode=mode)).peak_bytes for mode in ("none", "full"))
    return none + (none - full) // 20, (none - full) // 3


def one_strategy(out: Path, strategy: str, budget: int, extra: int) -> dict[str, Any]:
    reference = FinetuneRecipe(validate_recipe(recipe(out / "reference", strategy, budget))).run()

    cfg = validate_recipe(recipe(out / "replan", strategy, budget))
    adapter = adapter_for_recipe(cfg, world_size=2)  # as `remat finetune` makes it: plans in a child process
    job = FinetuneRecipe(cfg, replanner=adapter)
    job.setup()
    held: list[torch.Tensor] = []
    fired: list[int] = []

    def pre_hook(module: Any, args: Any) -> None:
        held.clear()  # a retry starts without it

    def hook(module: Any, args: Any, output: Any) -> None:
        if dist.get_rank() == 1 and job.step == 1 and not fired:
            fired.append(1)
            held.append(torch.ones(extra // 4))

    job.model.register_forward_pre_hook(pre_hook)
    job.model.register_forward_hook(hook)
    result = job.run()
    assert job.retry is not None
    return {"reference": outcomes(reference), "replanned": outcomes(result), "replans": job.retry.replans,
            "policy": adapter.policy.to_dict(), "applied": job.dist.plan.policy.to_dict() if job.dist.plan else None,
            "fired": bool(fired), "budget": budget, "mem": [r.mem_bytes for r in result.records]}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    strategies = sys.argv[2].split(",")
    sizes = {strategy: budget_and_extra(out / strategy, strategy) for strategy in strategies}
    report = {strategy: one_strategy(out / strategy, strategy, *sizes[strategy]) for strategy in strategies}
    (out / f"replan_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main()
