"""What each torchrun worker of the context-parallel tests runs: ``python cp_worker.py {2,4,mem} OUT_DIR``.

``2`` / ``4``: every case of ``CASES_2`` (or ``CASES_4``) of `cp_cases`, writing ``cp<N>_rank<r>.json`` (loss and
gradients per case) into OUT_DIR; the test compares them with one process. ``mem``: every recipe of
``MEMORY_CASES``, writing each rank's tracked peak of the second step (``cpmem_rank<r>.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from cp_cases import CASES_2, CASES_4, MEMORY_CASES, loss_and_grads, memory_recipe
from dist_recipes import leave_process_group

from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe


def peaks(out: Path) -> dict[str, int]:
    report = {}
    for name, case in MEMORY_CASES.items():
        job = FinetuneRecipe(validate_recipe(memory_recipe(str(out / name), *case)))
        job.run()
        report[name] = job.memory_meter.last.peak_bytes  # this rank's own, not the maximum over ranks
    return report


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    if mode == "mem":
        report: dict[str, object] = dict(peaks(out))
    else:
        report = {name: loss_and_grads(*case) for name, case in (CASES_2 if mode == "2" else CASES_4).items()}
    (out / f"cp{mode}_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main()
