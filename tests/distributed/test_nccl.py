"""On 2 GPUs (NCCL, one GPU per rank): FSDP2 and DDP train like one process on one GPU. Skipped with the reason on a
machine with fewer GPUs; the same cases run on 2 CPU ranks (gloo) in test_parity.py everywhere.

The single-process reference runs on a GPU too: the recipe builds the model on its device, so the initial weights
come from the CUDA generator (the same on every GPU for the same seed) and differ from a CPU run's. Tolerance: 1e-4
on losses (~6) and relative gradient norms, for the summation order of GPU reductions (cross-rank and in-kernel).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launches import run_worker
from dist_recipes import PARITY_CASES, reference_key, tiny_recipe
from dist_worker import NCCL_CASES

from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe

pytestmark = [pytest.mark.distributed, pytest.mark.gpus(2)]

TOLERANCE = 1e-4


def test_fsdp2_and_ddp_over_nccl_match_one_gpu(tmp_path: Path, remat_cache: Path) -> None:
    reports = run_worker("nccl", tmp_path / "nccl")
    for case in NCCL_CASES:
        fused, tied = reference_key(case)
        job = FinetuneRecipe(validate_recipe(tiny_recipe(tmp_path / f"single-{case}", fused=fused, tied=tied,
                                                         device="cuda")))
        reference = job.run()
        assert job.dist.device == torch.device("cuda", 0)
        for rank, report in enumerate(reports):
            got = report[case]
            assert got["device"] == f"cuda:{rank}" and "nccl" in got["describe"], got["describe"]
            assert got["describe"].startswith(f"{PARITY_CASES[case][0]} over 2 processes")
            assert set(got["mem_source"]) == {"cuda"}
            assert got["tokens"] == [r.num_label_tokens for r in reference.records]
            torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor([r.loss for r in reference.records]),
                                       atol=TOLERANCE, rtol=0)
            torch.testing.assert_close(torch.tensor(got["grad_norm"]),
                                       torch.tensor([r.grad_norm for r in reference.records]), rtol=TOLERANCE,
                                       atol=0)
        assert reports[0][case]["mem"] == reports[1][case]["mem"], "mem is the maximum over ranks"
