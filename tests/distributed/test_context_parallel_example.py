"""examples/long_context_cp.yaml: shipped, and `remat finetune ... --nproc-per-node 2` trains it on 2 CPU processes
(a tiny model override), each row cut over the 2 ranks of the context-parallel group; stopped by SIGINT, it saves and
resumes exactly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from processes import run_bounded

from remat.recipes.loader import load_recipe
from remat.recipes.shipped import shipped_recipes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "long_context_cp.yaml"


def test_the_example_is_shipped_and_cuts_rows_over_two_ranks() -> None:
    assert shipped_recipes()["long_context_cp"].summary.startswith("Context parallelism: each packed row")
    cfg = load_recipe(EXAMPLE, [])
    assert (cfg.distributed.strategy, cfg.distributed.cp_size, cfg.dataset.packing) == ("fsdp2", 2, True)
    assert cfg.loss_fn.target == "remat.loss.FusedLinearCrossEntropy"


@pytest.mark.distributed
@pytest.mark.slow
def test_the_example_trains_on_two_cpu_processes(tmp_path: Path, remat_cache: Path) -> None:
    command = [str(Path(sys.executable).parent / "remat"), "finetune", str(EXAMPLE), "--nproc-per-node", "2",
               "--model.preset", "tiny-llama", "--model.dtype", "float32", "--step_scheduler.max_steps", "2",
               "--step_scheduler.ckpt_every_steps", "2", "--output_dir", str(tmp_path / "out"),
               "--tokenizer.vocab_size", "512", "--dataset.seq_length", "510",
               "--distributed.activation_checkpointing.tile_tokens", "64"]
    proc = run_bounded(command, timeout=600, env=os.environ)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "fsdp2 over 2 processes (dp 1 x cp 2)" in out
    assert "each row cut over cp 2 ranks (255 tokens each)" in out
    assert "context parallel: remat_cp_sdpa" in out
    assert "step 2 | epoch 0 | loss" in out
    assert (tmp_path / "out" / "checkpoints" / "step_2" / "model").is_dir()


def _finetune(out: Path, *extra: str) -> list[str]:
    return [str(Path(sys.executable).parent / "remat"), "finetune", str(EXAMPLE), "--nproc-per-node", "2",
            "--model.preset", "tiny-llama", "--model.dtype", "float32", "--step_scheduler.max_steps", "6",
            "--step_scheduler.ckpt_every_steps", "100", "--output_dir", str(out), "--tokenizer.vocab_size", "512",
            "--dataset.seq_length", "256", "--distributed.activation_checkpointing.tile_tokens", "64",
            "--lr_scheduler.warmup_steps", "1", *extra]


def _losses(text: str) -> dict[int, str]:
    """step -> the loss as printed (4 decimals), from the step lines."""
    found = re.findall(r"^step (\d+) \| epoch \d+ \| loss ([0-9.]+)", text, flags=re.MULTILINE)
    return {int(step): loss for step, loss in found}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_context_parallel_run_stopped_by_sigint_resumes_exactly(tmp_path: Path, remat_cache: Path) -> None:
    """SIGINT to `remat finetune --nproc-per-node 2` of a cp_size 2 run after its second step: it saves and exits
    130; the same command resumes from that checkpoint, and its steps print the losses of a run never stopped."""
    straight = run_bounded(_finetune(tmp_path / "straight"), timeout=600, env=os.environ)
    assert straight.returncode == 0, straight.stderr[-3000:]
    want = _losses(straight.stdout)
    assert sorted(want) == [1, 2, 3, 4, 5, 6]

    proc = subprocess.Popen(_finetune(tmp_path / "stopped"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=os.environ, start_new_session=True)
    limit = threading.Timer(600, lambda: os.killpg(proc.pid, signal.SIGKILL))
    limit.start()
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("step 2 |"):
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=600)
    finally:
        limit.cancel()
    first = "".join(seen) + rest
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "saved checkpoint" in first, (first[-2000:], err[-6000:])
    stopped_at = max(_losses(first))
    assert 2 <= stopped_at < 6

    resumed = run_bounded(_finetune(tmp_path / "stopped"), timeout=600, env=os.environ)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = _losses(resumed.stdout)
    assert sorted(got) == list(range(stopped_at + 1, 7))
    assert got == {step: want[step] for step in got}
