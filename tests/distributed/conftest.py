"""Helpers of the distributed tests: one tokenizer cache for the folder, and torchrun launches of the worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from processes import run_bounded

HERE = Path(__file__).resolve().parent
WORKER = HERE / "dist_worker.py"
LAUNCH_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def remat_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tokenizer cache shared by the test process and its workers (the builtin BPE is trained once)."""
    cache = tmp_path_factory.mktemp("remat-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REMAT_CACHE_DIR", str(cache))
        yield cache


def run_torchrun(args: Sequence[str], *, cwd: Path | None = None, nproc: int = 2,
                 timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N ARGS``; fails the test with the output
    (after ``timeout`` seconds too, with the launcher and its workers ended)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = run_bounded(command, timeout=timeout, cwd=cwd, env=os.environ)
    assert proc.returncode == 0, f"{' '.join(command)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    return proc


def run_worker(mode: str, out: Path) -> list[dict[str, Any]]:
    """Run ``dist_worker.py MODE OUT`` on 2 ranks; returns each rank's report."""
    out.mkdir(parents=True, exist_ok=True)
    run_torchrun([str(WORKER), mode, str(out)])
    return [json.loads((out / f"{mode}_rank{rank}.json").read_text()) for rank in range(2)]
