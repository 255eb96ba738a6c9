"""Run-time re-planning on 2 CPU ranks (gloo): one rank over the budget makes every rank re-plan to the same policy
and retry the step, with the same losses and gradient norms as a run that never went over (see replan_worker.py);
a conservative first plan relaxes on every rank at the same step to the same plan (see relax_worker.py); an
out-of-memory error on one rank is re-planned after torchrun restarts the workers (see oom_restart_worker.py, whose
fsdp2 case also guards against DTensor caches keeping the fake mesh of an estimate made earlier in the process:
sharded checkpoint saves then failed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from launches import HERE, run_torchrun

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


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_out_of_memory_error_on_one_rank_is_replanned_after_a_restart(
        strategy: str, tmp_path: Path, remat_cache: Path) -> None:
    proc = run_torchrun(["--max-restarts=1", str(HERE / "oom_restart_worker.py"), str(tmp_path), strategy])
    out = proc.stdout + proc.stderr
    assert ("rank 1 ran out of memory at step 3 before its update; its peers wait in the step's collectives, so the "
            "step cannot be retried in place. Wrote ") in out
    assert "torchrun restarts the workers (1 restart(s) left)" in out
    replan = next(line for line in out.splitlines() if line.startswith("re-plan "))
    assert replan.startswith("re-plan 1/3 at step 3: out of memory on rank 1 (CUDA out of memory. Tried to allocate "
                             "2.00 GiB (injected)); activation checkpointing none")
    assert replan.endswith("; the workers were restarted: resuming after step 2"), replan
    reports = [json.loads((tmp_path / f"oom_rank{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(reports):
        assert report["generation"] == 1 and report["resumed"] == 2 and report["replans"] == 1, report
        assert report["policy"] == report["applied"] != {"mode": "none"}, report
        assert report["notes_left"] == [], report  # the finished run removed the note
        steps = [json.loads(line) for line in (tmp_path / f"steps_rank{rank}.jsonl").read_text().splitlines()]
        assert [(s["generation"], s["step"]) for s in steps] == [(0, 1), (0, 2), (1, 3), (1, 4)], steps
        # Steps 1-2 planned `none`, 3-4 re-planned after the restart: the same losses as the re-planned policy from
        # the start (checkpointing never changes the numbers).
        assert [[s["loss"], s["grad_norm"]] for s in steps] == report["reference"], (rank, steps, report)
    assert reports[0]["policy"] == reports[1]["policy"]
