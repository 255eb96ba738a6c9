"""What each torchrun worker of the context-parallel tests runs: ``python cp_worker.py {2,4,mem} OUT_DIR``.

``2`` / ``4``: every case of ``CASES_2`` (or ``CASES_4``) of `cp_cases` (``auto`` planned first), writing ``cp<N>_rank<r>.json`` (loss and
gradients per case) into OUT_DIR; the test compares them with one process. ``mem``: every recipe of
``MEMORY_CASES``, writing each rank's tracked peak of the second step (``cpmem_rank<r>.json``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from cp_cases import CASES_2, CASES_4, MEMORY_CASES, loss_and_grads, memory_recipe, planned
from dist_recipes import leave_process_group

from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe


def peaks(out: Path) -> dict[str, int]:
    report = {}
    for name, (checkpointing, loss) in MEMORY_CASES.items():
        job = FinetuneRecipe(validate_recipe(memory_recipe(str(out / name), checkpointing, loss)))
        job.run()
        report[name] = job.memory_meter.last.peak_bytes  # this rank's own, not the maximum over ranks
    return report


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    if mode == "mem":
        report: dict[str, object] = dict(peaks(out))
    else:
        cases = dict(CASES_2 if mode == "2" else CASES_4)
        for name, (kind, policy, fused, strategy, cp_size, *tp) in cases.items():
            if policy == "auto":  # each rank plans alike, before the first case joins the process group
                plan = planned(kind, fused, strategy, cp_size, int(os.environ["WORLD_SIZE"]))
                cases[name] = (kind, plan, fused, strategy, cp_size, *tp)
        report = {name: loss_and_grads(*case) for name, case in cases.items()}
    (out / f"cp{mode}_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main()
