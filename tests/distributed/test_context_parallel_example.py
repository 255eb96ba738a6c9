"""examples/long_context_cp.yaml: shipped, and `remat finetune ... --nproc-per-node 2` trains it on 2 CPU processes
(a tiny model override), each row cut over the 2 ranks of the context-parallel group."""

from __future__ import annotations

import os
import sys
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
