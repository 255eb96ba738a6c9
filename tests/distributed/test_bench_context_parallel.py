"""benchmarks/bench_context_parallel.py keeps working: ``--check-on-cpu`` on 2 gloo processes writes its table and
JSON, one row per length, with the peak over the ranks; started without torchrun it says so and runs nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launches import run_torchrun

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_context_parallel.py"


@pytest.mark.distributed
def test_the_benchmark_runs_on_two_cpu_processes(tmp_path: Path, remat_cache: Path) -> None:
    run_torchrun([str(BENCH), "--check-on-cpu", "--lengths", "126,254", "--steps", "1", "--out", str(tmp_path)])
    (table,) = tmp_path.glob("context_parallel_cpu_*_x2.md")
    payload = json.loads(table.with_suffix(".json").read_text())
    assert payload["meta"]["processes"] == 2
    assert [(row["tokens"], row["tokens_per_rank"]) for row in payload["rows"]] == [(126, 63), (254, 127)]
    for row in payload["rows"]:
        assert row["peak_bytes"] == max(row["peak_bytes_per_rank"]) > 0 and row["tokens_per_second"] > 0
    assert "fsdp2 over dp 1 x cp 2" in table.read_text()


def test_without_torchrun_it_says_how_to_start_it() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(BENCH), "--check-on-cpu"], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2 and "start it with torchrun" in proc.stderr
