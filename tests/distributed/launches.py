"""Launching the distributed tests' workers through torchrun (imported by the test modules of this folder)."""

from __future__ import annotations

import json
import os
import sys
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from processes import run_bounded

HERE = Path(__file__).resolve().parent
WORKER = HERE / "dist_worker.py"
LAUNCH_TIMEOUT_S = 600


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
