"""``--max-restarts 1`` survives a killed rank: one try of ``benchmarks/restart_trials.py`` (whose 20-try output is in
``benchmarks/results/restart_trials.md``): kill -9 of a random worker after step 2-3 of a 2-rank CPU run that saves
every step; the run must restart, resume from a checkpoint, reach max_steps with exit 0 and keep every checkpoint
that was complete at the kill."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest



@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc (Linux)")
def test_a_killed_rank_is_restarted_and_the_run_resumes(
        tmp_path: Path, remat_cache: Path,
        benchmark_script: Callable[[str], ModuleType]) -> None:
    trials = benchmark_script("restart_trials")
    settings = trials.TrialSettings(max_steps=6, ckpt_every=1, kill_after=(2, 3), max_delay_s=0.5, timeout_s=400)
    result = trials.run_trial(0, tmp_path, settings, random.Random(3))
    assert result.ok, f"{result.problems}\n{result.log_tail}"
    assert result.victim_rank in (0, 1) and result.step_at_kill is not None and result.step_at_kill >= 2
    assert result.resumed_from_step is not None and result.resumed_from_step >= 2
    assert result.final_step == 6 and result.exit_code == 0
    assert result.checkpoints_at_kill and f"step_{result.resumed_from_step}" in result.checkpoints_at_kill
