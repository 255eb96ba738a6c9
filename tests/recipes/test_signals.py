"""`remat finetune` stopped by a signal: says so at once, saves after the step, exits 130 (SIGINT), 143 (SIGTERM) or
129 (SIGHUP: a closed terminal)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from tiny import tiny_recipe

RECIPE = tiny_recipe(step_scheduler={"global_batch_size": 2, "max_steps": 100000})


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_signal_saves_and_exits_with_128_plus_signal(sig: signal.Signals, tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(RECIPE | {"output_dir": str(tmp_path / "run")}))
    env_cache = {"REMAT_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "remat.cli", "finetune", str(path)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | env_cache)
    limit = threading.Timer(300, proc.kill)  # reading its lines has no time limit of its own
    limit.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step 2 |"):
                break
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
    finally:
        limit.cancel()
        proc.kill()
    assert proc.returncode == 128 + sig, err
    assert f"received {sig.name}: stopping after the current step and saving a checkpoint" in err
    assert "Traceback" not in err
    assert "stopping at step" in out and "saved checkpoint" in out
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert saved and (tmp_path / "run" / "checkpoints" / saved[-1] / "model" / "config.json").is_file()
