"""FSDP2 and DDP on 2 CPU ranks (gloo) train like one process taking the same global batches.

Every case of ``PARITY_CASES`` (no checkpointing, full, selective; masked and fused loss, tied and untied output head;
tensor parallelism over 2 ranks) runs in one torchrun launch. Stated tolerance: per-step losses within 1e-5
(absolute, losses ~6), gradient norms and validation losses within 1e-5 relative: what is left is the order of
floating-point sums (two half-batches and a cross-rank reduction instead of one batch); measured differences are
about 5e-7.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launches import run_worker
from dist_recipes import PARITY_CASES, reference_key, tiny_recipe

from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe

pytestmark = pytest.mark.distributed

LOSS_ATOL = 1e-5
RTOL = 1e-5


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory, remat_cache: Path) -> list[dict[str, Any]]:
    return run_worker("parity", tmp_path_factory.mktemp("parity"))


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, remat_cache: Path) -> dict[tuple[bool, bool], Any]:
    """Single-process runs, one per (fused, tied) that a case uses."""
    out = {}
    for fused, tied in sorted({reference_key(case) for case in PARITY_CASES}):
        job = FinetuneRecipe(validate_recipe(tiny_recipe(tmp_path_factory.mktemp("single"), fused=fused, tied=tied)))
        out[(fused, tied)] = job.run()
    return out


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_losses_match_the_single_process_run(case: str, reports: list[dict[str, Any]],
                                             references: dict[tuple[bool, bool], Any]) -> None:
    reference = references[reference_key(case)]
    for report in reports:  # every rank reports the same global figures
        got = report[case]
        assert got["steps"] == [1, 2, 3, 4]
        assert got["tokens"] == [r.num_label_tokens for r in reference.records]
        torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor([r.loss for r in reference.records]),
                                   atol=LOSS_ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(got["grad_norm"]),
                                   torch.tensor([r.grad_norm for r in reference.records]), rtol=RTOL, atol=0)
        assert [step for step, _ in got["validation"]] == [2, 4]
        torch.testing.assert_close(torch.tensor([loss for _, loss in got["validation"]]),
                                   torch.tensor([loss for _, loss in reference.validation]), rtol=RTOL, atol=0)
    assert reports[0][case]["mem"] == reports[1][case]["mem"], "mem is the maximum over ranks, the same on each"


TP_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("case", [c for c, (strategy, *_) in PARITY_CASES.items() if strategy == "fsdp2"])
def test_fsdp2_parameters_are_sharded(case: str, reports: list[dict[str, Any]]) -> None:
    tp_size = PARITY_CASES[case][-1]
    for report in reports:
        shards = report[case]["shards"]
        assert report[case]["blocks"] == 2 * (case != "fsdp2-none")
        for name, (local, full, placements) in shards.items():
            # Checked after the last validation, whose forward leaves the root's parameters gathered until resharded.
            if tp_size == 1:  # FSDP2 over 2 ranks: every parameter split in two along dim 0 (all even here)
                assert (local * 2, placements) == (full, ["S(0)"]), name
            elif name.rsplit(".", 2)[-2] in TP_LAYERS:  # tensor parallel over 2 ranks, FSDP2 over 1: (dp, tp)
                assert local * 2 == full and len(placements) == 2, (name, local, full, placements)
                assert placements[1] == ("S(1)" if name.endswith(("o_proj.weight", "down_proj.weight")) else "S(0)")
            else:  # embeddings and norms are replicated over the tensor-parallel ranks
                assert local == full, name


def test_fsdp2_holds_less_per_rank_than_ddp(reports: list[dict[str, Any]]) -> None:
    # Same model, data and policy: sharded parameters, gradients and AdamW state (3 x param bytes halved), less what
    # FSDP2 holds gathered at the peak: the root's parameters (embeddings, final norm, head), gathered for the whole
    # forward and backward.
    fsdp2, ddp = reports[0]["fsdp2-none"]["mem"][-1], reports[0]["ddp-none"]["mem"][-1]
    shards = reports[0]["ddp-none"]["shards"]
    params = sum(full for _, full, _ in shards.values()) * 4
    root = sum(full for name, (_, full, _) in shards.items() if ".layers." not in name) * 4
    assert ddp - fsdp2 >= (1.5 * params - root) * 0.9, (fsdp2, ddp, params, root)


def test_ddp_parameters_are_whole(reports: list[dict[str, Any]]) -> None:
    for name, (local, full, placements) in reports[0]["ddp-none"]["shards"].items():
        assert local == full and placements == [], name


def test_tensor_parallel_plans_reproduce_one_process(reports: list[dict[str, Any]]) -> None:
    from remat.distributed.tensor_parallel import TP_PLANS

    families = reports[0]["tp-families"]
    assert set(families) == set(TP_PLANS)
    for model_type, (loss_error, grad_error) in families.items():
        assert loss_error < 1e-6 and grad_error < 1e-6, (model_type, loss_error, grad_error)


def test_fsdp2_options_train_like_the_default(reports: list[dict[str, Any]]) -> None:
    runs = reports[0]["fsdp2-options"]
    reference = runs["reference"]
    assert reference["param"] == ["torch.float32", "DTensor"]
    for name in ("deferred-reduction", "cpu-offload"):  # same arithmetic, other placement/timing of the reduction
        torch.testing.assert_close(torch.tensor(runs[name]["loss"]), torch.tensor(reference["loss"]),
                                   atol=LOSS_ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(runs[name]["grad_norm"]), torch.tensor(reference["grad_norm"]),
                                   rtol=RTOL, atol=0)
    # bf16 compute, fp32 reduction and fp32 sharded master weights: close, not equal.
    bf16 = runs["bf16"]
    assert bf16["param"] == ["torch.float32", "DTensor"]
    assert bf16["loss"] != reference["loss"]
    torch.testing.assert_close(torch.tensor(bf16["loss"]), torch.tensor(reference["loss"]), atol=2e-2, rtol=0)
