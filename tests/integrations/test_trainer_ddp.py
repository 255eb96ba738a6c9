"""`remat.prepare_trainer` in a Trainer on two processes (torchrun, DDP over gloo): the same per-step losses and
gradient norms as one process with the same global batch (selective checkpointing and the fused loss, whose
normalisation by ``num_items_in_batch`` spans the ranks and the accumulated micro-batches; prompts of several lengths
give the ranks different numbers of label tokens)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from processes import run_bounded

WORKER = Path(__file__).resolve().parent / "trainer_ddp_worker.py"


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ddp_processes_give_the_losses_of_one_with_the_same_global_batch(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = run_bounded([sys.executable, str(WORKER), str(tmp_path / "one.json"), "4"], timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-4000:]
    two = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       str(WORKER), str(tmp_path / "two.json"), "2"], timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-4000:]
    single, ddp = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert (single["world_size"], ddp["world_size"]) == (1, 2)
    assert len(ddp["loss"]) == 3
    assert ddp["loss"] == pytest.approx(single["loss"], rel=1e-6)
    assert ddp["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
