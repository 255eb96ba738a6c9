"""One writer under torchrun: rank 0 takes the output_dir lock and every rank stops with its message, or goes on
with the same attempt number."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import remat
from launches import HERE, run_torchrun

HOLDER = HERE.parent / "recipes" / "lock_holder.py"


def test_every_rank_stops_with_rank0s_message_and_agrees_on_the_attempt(tmp_path: Path, remat_cache: Path) -> None:
    held = tmp_path / "held"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(remat.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, str(HOLDER), str(held)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline().startswith("ready")
        run_torchrun([str(HERE / "lock_worker.py"), str(tmp_path), str(held)])
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    reports = [json.loads((tmp_path / f"lock_rank{rank}.json").read_text()) for rank in range(2)]
    expected = f"output_dir: {held.resolve()} is in use by another run (pid {holder.pid} on "
    assert all(r["refused"].startswith(expected) and not r["built"] for r in reports)
    assert reports[0]["refused"] == reports[1]["refused"]
    assert [(r["final_step"], r["attempt"]) for r in reports] == [(2, 1), (2, 1)]
    assert json.loads((tmp_path / "free" / ".remat.lock").read_text())["released"] is True
