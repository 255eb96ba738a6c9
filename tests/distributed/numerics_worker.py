"""What each torchrun worker of `test_numerics_ranks.py` runs: ``python numerics_worker.py OUT_DIR``.

For fsdp2 (fused AdamW: the update is skipped on the device through ``found_inf``, on DTensor parameters) and ddp
(plain AdamW: one host read of the flag), a 4-step run with ``training.on_nonfinite: skip`` whose step-3 loss is NaN
on rank 1 only, with finite gradients (a constant NaN added to the loss has zero gradient): only the loss, agreed over
the ranks, can tell rank 0 to skip. Each rank writes ``numerics_rank<r>.json``: which steps were skipped, whether its
parameter shards and optimizer state after step 3 equal those after step 2 bit for bit, and whether all are finite.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_recipes import leave_process_group, tiny_recipe

from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe


def local_state(job: FinetuneRecipe) -> list[torch.Tensor]:
    tensors = [p for p in job.model.parameters()]
    tensors += [v for state in job.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return [(t.to_local() if hasattr(t, "to_local") else t).detach().clone() for t in tensors]


def nan_loss_on_rank_1_at_step_3(out: Path, strategy: str, fused: bool) -> dict[str, Any]:
    kept: dict[int, list[torch.Tensor]] = {}
    handles: list[Any] = []

    def callback(job: FinetuneRecipe, record: Any) -> None:
        kept[record.step] = local_state(job)
        while handles:
            handles.pop().remove()
        if record.step == 2 and dist.get_rank() == 1:
            handles.append(job.compute_loss.register_forward_hook(lambda module, args, loss: loss + float("nan")))

    recipe = tiny_recipe(out, strategy=strategy, max_steps=4, training={"on_nonfinite": "skip"},
                         optimizer={"fused": fused}, step_scheduler={"val_every_steps": None})
    job = FinetuneRecipe(validate_recipe(recipe), callbacks=[callback])
    result = job.run()
    unchanged = all(torch.equal(a, b) for a, b in zip(kept[2], kept[3], strict=True))
    changed_after = any(not torch.equal(a, b) for a, b in zip(kept[3], kept[4], strict=True))
    return {"skipped": [r.skipped for r in result.records], "loss": [r.loss for r in result.records],
            "grad_norm": [r.grad_norm for r in result.records], "unchanged_by_step_3": unchanged,
            "changed_by_step_4": changed_after, "finite": all(bool(torch.isfinite(t).all()) for t in kept[4])}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    report = {name: nan_loss_on_rank_1_at_step_3(out / name, strategy, fused)
              for name, strategy, fused in (("fsdp2-fused", "fsdp2", True), ("ddp", "ddp", False))}
    (out / f"numerics_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main()
