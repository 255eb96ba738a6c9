"""What each torchrun rank of tests/distributed/test_run_lock_ranks.py runs: ``python lock_worker.py OUT HELD``.

HELD is an output_dir whose lock another process holds: every rank must stop with rank 0's one-line message before
building anything. Then both ranks train 2 ddp steps in a free output_dir and report the attempt they agreed on."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_recipes import leave_process_group, tiny_recipe
from remat.errors import ConfigError
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe


def main() -> None:
    out, held = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    refused = FinetuneRecipe(validate_recipe(tiny_recipe(held, strategy="ddp", max_steps=2)))
    try:
        refused.run()
        report["refused"] = None
    except ConfigError as err:
        report["refused"] = str(err)
    report["built"] = hasattr(refused, "model")
    job = FinetuneRecipe(validate_recipe(tiny_recipe(out / "free", strategy="ddp", max_steps=2,
                                                     checkpoint={"enabled": True})))
    result = job.run()
    report.update(final_step=result.final_step, attempt=job.attempt)
    (out / f"lock_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main()
