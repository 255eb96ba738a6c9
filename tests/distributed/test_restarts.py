"""``--max-restarts 1`` survives a killed rank: one try of ``benchmarks/restart_trials.py`` (whose 20-try output is in
``benchmarks/results/restart_trials.md``): kill -9 of one worker soon after step 2 of a 10-step, 2-rank CPU run
that saves every step; the run must restart, resume from the newest checkpoint complete at the kill, reach max_steps
with exit 0 and keep every checkpoint that was complete at the kill."""

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
    # Ten steps, the kill 0-0.1 s after step 2 or 3 is logged: it lands mid-run on a fast machine too (a step took
    # 30-90 ms here, plus its save). With the former 6 steps and up to 0.5 s, 0.4 s more put the kill after step 6.
    settings = trials.TrialSettings(max_steps=10, ckpt_every=1, kill_after=(2, 3), max_delay_s=0.1, timeout_s=400)
    result = trials.run_trial(0, tmp_path, settings, random.Random(3))
    assert result.ok, f"{result.problems}\n{result.log_tail}"
    assert result.victim_rank == 0  # what seed 3 draws: the rank that writes the checkpoints
    assert result.step_at_kill is not None and 2 <= result.step_at_kill < settings.max_steps
    assert result.final_step == settings.max_steps and result.exit_code == 0
    # The workers were stopped while the checkpoints were listed, and the writer was killed: the resume is from the
    # newest checkpoint listed, which is the step logged last or (its save cut short) the one before.
    newest = max((int(name.rsplit("_", 1)[1]) for name in result.checkpoints_at_kill), default=0)
    assert result.resumed_from_step == newest, (result.checkpoints_at_kill, result.resumed_from_step)
    assert result.step_at_kill - 1 <= newest <= result.step_at_kill
