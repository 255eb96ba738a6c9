"""The numerics guard over 2 ranks: a NaN loss on one rank only (finite gradients everywhere) makes every rank skip
the same step, leaving weights and optimizer state untouched, for fsdp2 with fused AdamW (``found_inf`` on DTensor
parameters) and ddp with plain AdamW."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launches import HERE, run_torchrun

pytestmark = pytest.mark.distributed


def test_a_nan_loss_on_one_rank_is_skipped_by_every_rank(tmp_path: Path, remat_cache: Path) -> None:
    run_torchrun([str(HERE / "numerics_worker.py"), str(tmp_path)])
    reports = [json.loads((tmp_path / f"numerics_rank{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        for name in ("fsdp2-fused", "ddp"):
            run = report[name]
            assert run["skipped"] == [False, False, True, False], name
            assert run["unchanged_by_step_3"] and run["changed_by_step_4"] and run["finite"], name
            assert run["loss"][2] != run["loss"][2]  # NaN: the logged loss is the global one
            assert all(norm == norm for norm in run["grad_norm"])  # the gradients never were non-finite
    assert reports[0]["ddp"]["loss"] == reports[1]["ddp"]["loss"]
