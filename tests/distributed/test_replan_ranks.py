"""Run-time re-planning on 2 CPU ranks (gloo): one rank over the budget makes every rank re-plan to the same policy
and retry the step, with the same losses and gradient norms as a run that never went over (see replan_worker.py);
a conservative first plan relaxes on every rank at the same step to the same plan (see relax_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import HERE, run_torchrun

STRATEGIES = ("ddp", "fsdp2")


@pytest.mark.slow
@pytest.mark.distributed
def test_one_rank_over_budget_makes_every_rank_replan_and_retry(tmp_path: Path, remat_cache: Path) -> None:
    run_torchrun([str(HERE / "replan_worker.py"), str(tmp_path), ",".join(STRATEGIES)])
    for strategy in STRATEGIES:
        check(strategy, [json.loads((tmp_path / f"replan_rank{rank}.json").read_text())[strategy] for rank in range(2)])


def check(strategy: str, reports: list[dict[str, Any]]) -> None:
    assert reports[0]["fired"] is False and reports[1]["fired"] is True, strategy  # rank 1 alone went over
    for report in reports:
        assert report["replans"] == 1, (strategy, report)
        assert report["replanned"] == report["reference"], (strategy, report)
        assert report["policy"] == report["applied"] != {"mode": "none"}, (strategy, report)
        assert all(mem <= report["budget"] for mem in report["mem"]), (strategy, report)
    assert reports[0]["policy"] == reports[1]["policy"], strategy
    assert reports[0]["replanned"] == reports[1]["replanned"], strategy  # the logged loss is the global one


@pytest.mark.slow
@pytest.mark.distributed
def test_every_rank_relaxes_to_the_same_plan_at_the_same_step(tmp_path: Path, remat_cache: Path) -> None:
    run_torchrun([str(HERE / "relax_worker.py"), str(tmp_path), ",".join(STRATEGIES)])
    for strategy in STRATEGIES:
        reports = [json.loads((tmp_path / f"relax_rank{rank}.json").read_text())[strategy] for rank in range(2)]
        for report in reports:
            assert report["relaxes"] == 1 and report["replans"] == 0, (strategy, report)
            # the plan in force after each step: full after steps 1-2, the relaxed plan from step 3's end on
            assert report["plans"] == [{"mode": "full"}] * 2 + [report["policy"]] * 2, (strategy, report)
            assert report["relaxed"] == report["reference"], (strategy, report)
            assert all(mem <= report["budget"] for mem in report["mem"]), (strategy, report)
        assert reports[0]["policy"] == reports[1]["policy"] != {"mode": "full"}, strategy
        assert reports[0]["relaxed"] == reports[1]["relaxed"], strategy
