"""What each torchrun worker of the context-parallel tests runs: ``python cp_worker.py {2,4} OUT_DIR``.

Runs every case of ``CASES_2`` (or ``CASES_4``) of `cp_cases` and writes ``cp<N>_rank<r>.json`` (loss and gradients
per case) into OUT_DIR; the test compares them with one process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from cp_cases import CASES_2, CASES_4, loss_and_grads
from dist_recipes import leave_process_group


def main() -> None:
    world, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    cases = CASES_2 if world == "2" else CASES_4
    report = {name: loss_and_grads(*case) for name, case in cases.items()}
    (out / f"cp{world}_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main()
