"""The planner considers offloading the kept block inputs on a GPU (``target="cuda"``): priced by the estimate, which
models the offload, and timed with the host<->device copies at a stated bandwidth."""

from __future__ import annotations

import pytest
import torch

from remat.checkpointing import CheckpointPolicy
from remat.errors import ConfigError
from remat.estimate import StepSettings
from remat.models import ModelConfig
from remat.planner import Planner

LAYERS, SEQ, HIDDEN = 6, 16384, 256
MODEL = ModelConfig(preset="tiny-llama", config={"num_hidden_layers": LAYERS, "vocab_size": 512})
SETTINGS = StepSettings(batch_size=1, seq_length=SEQ, dtype="bfloat16", loss="fused", target="cuda")
HOST_BYTES = LAYERS * SEQ * HIDDEN * 2  # every block's input, bf16


@pytest.fixture(autouse=True)
def _one_thread() -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_budget_only_offload_meets_is_planned_with_offload_and_its_copies_are_timed() -> None:
    planner = Planner.from_settings(MODEL, SETTINGS, host_bandwidth=10e9)
    full = planner.estimate(CheckpointPolicy(mode="full"))
    budget = full.peak_bytes - 16 * 2**20  # full checkpointing misses it by 4 MiB; offloading its inputs saves more
    plan = planner.plan(budget)
    assert plan.policy.to_dict() == {"mode": "full", "offload": True}
    assert plan.peak_bytes <= budget
    assert all(block.offload and block.mode == "full" for block in plan.blocks)
    assert plan.transfer_bytes == 2 * HOST_BYTES  # out and back, once per micro-batch
    assert plan.transfer_seconds == pytest.approx(2 * HOST_BYTES / 10e9)
    assert f"host<->device copies {2 * HOST_BYTES / 1e9:.2f} GB" in plan.summary()
    assert any("10 GB/s" in note for note in plan.notes)
    labels = {c.label: c for c in plan.candidates}
    assert not labels["full"].fits and labels["full, inputs offloaded"].fits
    assert plan.to_dict()["transfer_bytes"] == 2 * HOST_BYTES
    # where full checkpointing fits, offloading its inputs adds copies and saves no recompute: not chosen
    roomy = planner.plan(full.peak_bytes)
    assert not roomy.policy.offload and roomy.transfer_bytes == 0
    assert "host<->device" not in roomy.summary()


@pytest.mark.parametrize("bandwidth", [0, -1.0, True, "20GB/s"])
def test_host_bandwidth_must_be_a_positive_number(bandwidth: object) -> None:
    with pytest.raises(ConfigError, match="host_bandwidth: got"):
        Planner.from_settings(MODEL, SETTINGS, host_bandwidth=bandwidth)  # type: ignore[arg-type]
