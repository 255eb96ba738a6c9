"""Never lose a good checkpoint: a short form of ``benchmarks/fault_injection.py`` (whose long form is in
``benchmarks/results/fault_injection.md``): kill -9 during saves of one process (2 tries), and same-size corruption
of every file kind of a single-process checkpoint (all at once, one resume); no checkpoint may be lost and every
re-run must resume from the newest checkpoint that verifies. (A kill of one of 2 ranks: the long form, and
``test_restarts.py`` with ``--max-restarts``.)"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest



def test_flipped_bytes_keep_the_size_and_stay_in_the_named_region(tmp_path: Path,
        benchmark_script: Callable[[str], ModuleType]) -> None:
    faults = benchmark_script("fault_injection")
    header = b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    original = len(header).to_bytes(8, "little") + header + bytes(range(8))
    path = tmp_path / "model.safetensors"
    for kind, region in (("safetensors_header", range(8, 8 + len(header))),
                         ("safetensors_data", range(8 + len(header), len(original)))):
        path.write_bytes(original)
        offset = faults.corrupt_file(path, kind, random.Random(1))
        changed = [i for i, (a, b) in enumerate(zip(original, path.read_bytes())) if a != b]
        assert len(path.read_bytes()) == len(original) and changed and offset == changed[0]
        assert all(i in region for i in changed), (kind, changed)


def test_a_vanished_checkpoint_counts_as_lost_unless_newer_ones_replace_it(
        tmp_path: Path,
        benchmark_script: Callable[[str], ModuleType]) -> None:
    faults = benchmark_script("fault_injection")
    root = tmp_path / "checkpoints"
    root.mkdir()
    assert faults.lost_after_kill(root, ["step_1", "step_2"], keep_last=2) == (["step_1", "step_2"], [])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc (Linux)")
def test_kills_during_saves_and_corrupt_files_lose_no_checkpoint(
        tmp_path: Path, remat_cache: Path,
        benchmark_script: Callable[[str], ModuleType]) -> None:
    faults = benchmark_script("fault_injection")
    settings = faults.FaultSettings(max_steps=5, timeout_s=240)
    results = faults.run_scenarios(["single", "corrupt_stacked"], 1, tmp_path, settings, seed=5, echo=False)
    results += faults.run_scenarios(["single"], 1, tmp_path / "again", settings, seed=6, echo=False)
    failed = [f"{r.scenario} {r.detail}: {r.problems} {r.lost}\n{r.log_tail}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    rows = {row["scenario"]: row for row in faults.summarize(results)}
    assert rows["single"]["trials"] == 2 and rows["corrupt_stacked"]["trials"] == 1
    assert all(row["lost"] == 0 and row["resumed_correctly"] == row["trials"] for row in rows.values())
    assert "resumed from 1" in results[1].detail and "steps 8..2" in results[1].detail
