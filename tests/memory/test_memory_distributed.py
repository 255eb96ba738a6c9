"""Two gloo CPU ranks: the tracker under FSDP2 (DTensor ops seen locally, storage resizes followed) and
max_over_ranks. One process launch serves both, to keep the suite fast."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

from remat.memory import LiveTensorTracker, MemoryReading, max_over_ranks

F32 = 4
DIM, HIDDEN, BATCH, LAYERS = 64, 256, 8, 3
FULL_PARAM_BYTES = LAYERS * (DIM * HIDDEN + HIDDEN + HIDDEN * DIM + DIM) * F32
SHARD = FULL_PARAM_BYTES // 2
SAVED = LAYERS * (BATCH * HIDDEN + BATCH * DIM) * F32  # relu outputs and block outputs
AFTER_FORWARD = SHARD + SAVED + F32  # + the loss


def _settled(tracker: LiveTensorTracker, expected: int, seconds: float = 5.0) -> None:
    """Give buffers whose last reference is dropped outside this thread's Python code time to go.

    Once on CI (torch 2.15; not reproduced in ~100 local runs, loaded or not) the count right after forward was
    higher by exactly one block of full parameters, the size of one FSDP2 all-gather buffer, whose last reference
    FSDP2's deferred all-gather state or gloo's work object drops. Waiting a little (collecting cycles) lets such a
    straggler go; a tracker that missed the `resize_(0)` of the unsharded parameters never reaches `expected`.
    """
    deadline = time.monotonic() + seconds
    while tracker.current_bytes != expected and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)


def _worker(rank: int, world_size: int, store: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM)) for _ in range(LAYERS)]
        )
        for block in model:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
        x = torch.randn(BATCH, DIM)
        with LiveTensorTracker(module=model, optimizer=optimizer) as tracker:
            loss = model(x).pow(2).mean()
            _settled(tracker, AFTER_FORWARD)
            tracker.mark("after_forward")
            breakdown_after_forward = tracker.current_breakdown
            loss.backward()
            tracker.mark("after_backward")
            optimizer.step()
            tracker.mark("after_step")
        local = MemoryReading(peak_bytes=1000 * (rank + 1), source="tracked", breakdown={"temporaries": 1}, phase="p")
        combined = max_over_ranks(local)
        report = {
            "marks": tracker.marks,
            "peak": tracker.peak_bytes,
            "breakdown": tracker.peak_breakdown,
            "breakdown_after_forward": breakdown_after_forward,
            "max_over_ranks": [combined.peak_bytes, combined.source, combined.breakdown, combined.phase],
        }
        Path(results, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()
    # Occasionally gloo's threads abort the worker's interpreter teardown ("terminate called without an active
    # exception", SIGABRT) after everything above succeeded; the results are on disk, so skip static destructors.
    os._exit(0)


@pytest.mark.distributed
def test_fsdp2_step_counts_local_shards_and_max_over_ranks_agrees(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    shard, loss, step_counters = SHARD, F32, LAYERS * 4 * F32
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # Unsharded parameters are all-gathered per block and freed by `storage.resize_(0)` after use: if the
        # tracker missed the resize they would still be counted after forward.
        assert report["marks"] == {
            "after_forward": AFTER_FORWARD,
            "after_backward": 2 * shard + loss,
            "after_step": 4 * shard + step_counters + loss,
        }, report["breakdown_after_forward"]
        breakdown = report["breakdown"]
        assert breakdown["parameters"] == breakdown["gradients"] == shard
        assert sum(breakdown.values()) == report["peak"]
        assert report["max_over_ranks"] == [2000, "tracked", None, None]
