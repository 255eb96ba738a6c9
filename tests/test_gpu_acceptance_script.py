"""benchmarks/gpu_acceptance.sh, the one command for the GPU acceptance runs: its usage, its refusal of an unknown part,
and a measuring part without a CUDA device (it must stop with the benchmark's own message, not pass silently)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_acceptance.sh"


def _run(*parts: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable, "WHEELS_DIR": str(tmp_path / "no-wheels"), "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *parts], capture_output=True, text=True, env=env, timeout=120)


def test_without_a_part_it_prints_its_usage_and_fails(tmp_path: Path) -> None:
    done = _run(tmp_path=tmp_path)
    assert done.returncode == 2
    for part in ("wheels", "suite", "policies", "loss", "backends", "selective", "estimate", "profile", "long",
                 "context", "trl", "pareto"):
        assert f"gpu_acceptance.sh {part}" in done.stdout


def test_an_unknown_part_is_named_with_the_allowed_ones(tmp_path: Path) -> None:
    done = _run("polices", tmp_path=tmp_path)
    assert done.returncode == 1
    assert ("unknown part 'polices'; allowed: wheels cuda-tests suite policies loss backends selective estimate "
            "profile long context trl pareto") in done.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="measures for real where CUDA is present")
def test_a_measuring_part_without_cuda_fails_with_the_benchmarks_reason(tmp_path: Path) -> None:
    done = _run("policies", tmp_path=tmp_path)
    assert done.returncode == 1
    assert "no CUDA device" in done.stdout + done.stderr
    assert "== gpu_acceptance: policies ended with status 2" in done.stdout


@pytest.mark.skipif(__import__("torch").cuda.device_count() >= 2, reason="measures for real on several GPUs")
def test_the_context_part_needs_several_gpus(tmp_path: Path) -> None:
    done = _run("context", tmp_path=tmp_path)
    assert done.returncode == 1
    assert "gpu_acceptance: context needs 2 or more GPUs; this machine has" in done.stderr
