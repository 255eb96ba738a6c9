"""What each torchrun worker of `test_replan_ranks.py::test_an_out_of_memory_error_on_one_rank_is_replanned_after_a_restart`
runs: ``python oom_restart_worker.py OUT_DIR STRATEGY`` under ``torchrun --max-restarts 1``.

4 steps of the tiny Llama of replan_worker.py, planned (as `remat finetune` plans ``auto``) for a budget just above
the no-checkpointing peak, a checkpoint after every step. In the first generation rank 1 raises an out-of-memory
error in step 3's forward: it must leave its note and fail, torchrun restarts both workers, and the second
generation must resume from step 2, re-plan from the note before its first step and finish. Every step each rank
trains appends ``{generation, step, loss, grad_norm}`` to ``steps_rank<r>.jsonl``; the second generation then trains
a reference run given the re-planned policy from the start and writes ``oom_rank<r>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_recipes import leave_process_group
from replan_worker import budget_and_extra, outcomes, recipe

from remat.adaptation.adapter import adapter_for_recipe
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe
from remat.adaptation.oom_notes import NOTE_PREFIX, restart_generation

OOM_STEP = 3


def with_checkpoints(out: Path, strategy: str, budget: int, policy: Any = "none") -> dict[str, Any]:
    data = recipe(out, strategy, budget)
    data["step_scheduler"].update(max_steps=4, ckpt_every_steps=1)
    data["checkpoint"] = {"enabled": True, "save_final": False}
    data["distributed"]["activation_checkpointing"]["plan"] = policy  # what auto planned
    return data


def main() -> None:
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    generation = restart_generation()
    budget, _ = budget_and_extra(out / "probe", strategy)  # before the process group (the fsdp2 estimate)
    cfg = validate_recipe(with_checkpoints(out / "run", strategy, budget))
    adapter = adapter_for_recipe(cfg, world_size=2)
    job = FinetuneRecipe(cfg, replanner=adapter, callbacks=[lambda job, record: log_step(out, generation, record)])
    job.setup()
    if generation == 0:
        forward = job.compute_loss

        def out_of_memory_on_rank_1(batch: Any, **kwargs: Any) -> torch.Tensor:
            if dist.get_rank() == 1 and job.step == OOM_STEP - 1:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return forward(batch, **kwargs)

        job.compute_loss = out_of_memory_on_rank_1  # type: ignore[assignment]
    resumed = job.step
    job.run()  # generation 0: rank 1 fails here (and rank 0 is ended by torchrun)
    assert job.retry is not None
    reference_data = with_checkpoints(out / "reference", strategy, budget, adapter.policy.to_dict())
    reference_data["checkpoint"]["enabled"] = False
    reference = FinetuneRecipe(validate_recipe(reference_data)).run()
    report = {"generation": generation, "resumed": resumed, "replans": job.retry.replans,
              "policy": adapter.policy.to_dict(), "applied": job.dist.plan.policy.to_dict() if job.dist.plan else None,
              "reference": outcomes(reference),
              "notes_left": sorted(p.name for p in job.checkpoint_dir.glob(f"{NOTE_PREFIX}*"))}
    (out / f"oom_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


def log_step(out: Path, generation: int, record: Any) -> None:
    with open(out / f"steps_rank{dist.get_rank()}.jsonl", "a") as handle:
        handle.write(json.dumps({"generation": generation, "step": record.step, "loss": record.loss,
                                 "grad_norm": record.grad_norm}) + "\n")


if __name__ == "__main__":
    main()
