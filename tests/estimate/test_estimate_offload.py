"""The estimate of offloading policies on ``target="cuda"``: the fake tensors stand for device tensors, the offload
context's host copies are host memory, reported apart (`MemoryEstimate.host_peak_bytes`, `remat estimate`'s text
and JSON) and kept out of the device peak."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from remat.estimate.api import MemoryEstimate, estimate_memory
from remat.units import format_bytes

LAYERS, BATCH, SEQ, HIDDEN = 4, 2, 1024, 256  # tiny-llama: a block input is 2 MiB in fp32
BLOCK_INPUT = BATCH * SEQ * HIDDEN * 4
SETTINGS: dict[str, Any] = {"batch_size": BATCH, "seq_length": SEQ, "loss": "fused", "target": "cuda"}


@pytest.fixture(scope="module")
def full_and_offloaded() -> tuple[MemoryEstimate, MemoryEstimate]:
    return (estimate_memory("tiny-llama", policy="full", **SETTINGS),
            estimate_memory("tiny-llama", policy={"mode": "full", "offload": True}, **SETTINGS))


def test_offloaded_block_inputs_are_host_bytes_not_device_bytes(
        full_and_offloaded: tuple[MemoryEstimate, MemoryEstimate]) -> None:
    full, offloaded = full_and_offloaded
    assert full.host_peak_bytes == 0
    assert offloaded.host_peak_bytes == LAYERS * BLOCK_INPUT  # every block's kept input, until its backward
    # by the loss every block input is in host memory; the device holds the last block's output only
    assert full.phase_peaks["loss"] - offloaded.phase_peaks["loss"] >= (LAYERS - 1) * BLOCK_INPUT
    assert offloaded.peak_bytes <= full.peak_bytes  # (tiny-llama: the peak is set after the blocks, where both agree)
    assert any("4 tensors (0.008 GiB) copied to host memory" in note for note in offloaded.notes), offloaded.notes


def test_the_comparison_names_the_host_bytes_of_offloading_rows(
        full_and_offloaded: tuple[MemoryEstimate, MemoryEstimate]) -> None:
    from remat.estimate.report import breakdown_table, comparison_table

    full, offloaded = full_and_offloaded
    lines = comparison_table([full, offloaded]).splitlines()
    host_lines = [line for line in lines if "host memory for offloaded activations" in line]
    assert host_lines == [f"{offloaded.name}: host memory for offloaded activations, at most: "
                          f"{format_bytes(offloaded.host_peak_bytes)} (per rank, not part of the peak)"]
    assert "host memory" not in breakdown_table(full)


def test_pinned_host_copies_take_power_of_two_blocks() -> None:
    """1.5 MiB block inputs: pinned by the caching host allocator in 2 MiB blocks on a GPU."""
    odd = estimate_memory("tiny-llama", policy={"mode": "full", "offload": True}, **{**SETTINGS, "seq_length": 768})
    assert BATCH * 768 * HIDDEN * 4 == 3 * 2**20 // 2
    assert odd.host_peak_bytes == LAYERS * 2**21


def test_offload_mode_moves_what_blocks_save() -> None:
    none = estimate_memory("tiny-llama", policy="none", **SETTINGS)
    offload = estimate_memory("tiny-llama", policy="offload", **SETTINGS)
    # what the blocks save, minus what stays (smaller than min_bytes), is held in host memory instead
    assert offload.host_peak_bytes > 0.8 * (none.breakdown["activations"] - offload.breakdown["activations"])
    assert offload.peak_bytes < none.peak_bytes - LAYERS * 4 * BLOCK_INPUT


def test_remat_estimate_prints_and_writes_the_host_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main

    out = tmp_path / "estimate.json"
    assert main(["estimate", "--preset", "tiny-llama", "--batch-size", str(BATCH), "--seq-length", str(SEQ),
                 "--loss", "fused", "--policy", "{mode: full, offload: true}", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"host memory for offloaded activations, at most: {format_bytes(LAYERS * BLOCK_INPUT)} (per rank" in printed
    assert json.loads(out.read_text())["host_peak_bytes"] == LAYERS * BLOCK_INPUT
