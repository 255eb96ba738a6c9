"""StepMemoryMeter: source selection, the tracked/RSS readings, errors, and the cross-rank maximum."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from remat.errors import ConfigError
from remat.memory import LiveTensorTracker, MemoryReading, StepMemoryMeter, max_over_ranks
from remat.memory import rss as rss_module


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    return model, torch.optim.AdamW(model.parameters(), foreach=True)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_unknown_source_is_a_config_error_listing_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"memory source: got 'gpu'; allowed: 'auto', 'cuda', 'tracked', 'rss'"):
        StepMemoryMeter("gpu")  # type: ignore[arg-type]


def _cuda_available(monkeypatch: pytest.MonkeyPatch, available: bool) -> None:
    """Pretend CUDA is (or is not) available: only the source choice is tested with it, nothing runs on CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)


def test_cuda_source_without_cuda_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda_available(monkeypatch, False)
    with pytest.raises(ConfigError, match=r"got 'cuda' but torch.cuda.is_available\(\) is False"):
        StepMemoryMeter("cuda")


def test_auto_is_tracked_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda_available(monkeypatch, False)
    assert StepMemoryMeter().source == "tracked"
    assert StepMemoryMeter(device="cpu").source == "tracked"


def test_auto_follows_the_model_or_device_when_cuda_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda_available(monkeypatch, True)
    assert StepMemoryMeter().source == "cuda"  # nothing says where the step runs: the GPU
    assert StepMemoryMeter(device="cpu").source == "tracked"
    assert StepMemoryMeter(model=nn.Linear(2, 2)).source == "tracked"  # a CPU model is measured on the CPU
    with pytest.raises(ConfigError, match=r"got 'cuda' for a model on cpu"):
        StepMemoryMeter("cuda", model=nn.Linear(2, 2))


@pytest.mark.gpus(1)
def test_cuda_reading_is_the_allocator_peak_of_the_step() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model = nn.Linear(1024, 1024, device=device)
    meter = StepMemoryMeter(model=model)
    assert meter.source == "cuda"
    size = 256 * 2**20
    held = torch.cuda.memory_allocated(device)
    with meter.step():
        big = torch.empty(size // 4, device=device)
        del big
    reading = meter.last
    assert reading.source == "cuda" and reading.description == "CUDA allocator peak (max_memory_allocated)"
    assert reading.peak_bytes == torch.cuda.max_memory_allocated(device)
    assert held + size <= reading.peak_bytes < held + size + 2**20
    with meter.step():  # the peak is reset per step
        pass
    assert meter.last.peak_bytes == torch.cuda.memory_allocated(device) < reading.peak_bytes


def test_tracked_reading_is_the_whole_step_peak_including_optimizer_state() -> None:
    model, optimizer = _model_and_optimizer()
    x = torch.randn(16, 32)
    _step(model, optimizer, x)  # the optimizer state now exists
    meter = StepMemoryMeter("tracked", model=model, optimizer=optimizer)
    with meter.step():
        _step(model, optimizer, x)
    with LiveTensorTracker(module=model, optimizer=optimizer) as tracker:
        _step(model, optimizer, x)
    reading = meter.last
    param_bytes = sum(p.numel() for p in model.parameters()) * 4
    assert reading.source == "tracked"
    assert reading.peak_bytes == tracker.peak_bytes
    assert reading.breakdown == tracker.peak_breakdown
    assert reading.breakdown is not None and sum(reading.breakdown.values()) == reading.peak_bytes
    assert reading.breakdown["parameters"] == param_bytes
    assert reading.breakdown["optimizer_state"] == 2 * param_bytes + 4 * 4  # exp_avg, exp_avg_sq, 4 step counters
    assert reading.peak_bytes > 4 * param_bytes


def test_per_step_model_and_marks_reach_the_tracker() -> None:
    model, optimizer = _model_and_optimizer()
    meter = StepMemoryMeter("tracked")
    with meter.step(model=model, optimizer=optimizer):
        loss = model(torch.randn(16, 32)).pow(2).mean()
        meter.mark("after_forward")
        loss.backward()
    reading = meter.last
    assert reading.breakdown is not None
    assert reading.breakdown["parameters"] == sum(p.numel() for p in model.parameters()) * 4
    assert reading.phase == "after_forward"  # the backward peak comes after the mark


def test_last_before_any_step_and_after_a_failed_step() -> None:
    meter = StepMemoryMeter("tracked")
    with pytest.raises(RuntimeError, match="no step has been measured yet"):
        _ = meter.last
    with meter.step():
        kept = torch.empty(256)
    with pytest.raises(ValueError, match="boom"):
        with meter.step():
            raise ValueError("boom")
    assert meter.last.peak_bytes == 1024  # the failed step left the previous reading
    del kept


_RSS_STEPS = """
import json, torch
from remat.memory import StepMemoryMeter
meter = StepMemoryMeter("rss")
size = 64 * 2**20
with meter.step():
    big = torch.ones(size // 4)
    del big
first = meter.last
with meter.step():
    pass
print(json.dumps([first.source, first.peak_bytes, meter.last.peak_bytes]))
"""


def test_rss_reading_covers_a_large_allocation_inside_the_step() -> None:
    """In a fresh process: in the suite's own, the heap that earlier tests freed (the causal-LM sweep builds a
    hundred models) can serve the 64 MiB without raising the resident set, and both steps then read the same."""
    proc = subprocess.run([sys.executable, "-c", _RSS_STEPS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    source, first, idle = json.loads(proc.stdout.strip().splitlines()[-1])
    size = 64 * 2**20
    assert source in ("rss", "rss-lifetime")
    assert first >= size
    if source == "rss":  # the high-water mark was reset per step: the idle step peaks lower
        assert idle <= first - size // 2


def test_rss_falls_back_to_the_lifetime_peak_when_it_cannot_be_reset(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(rss_module, "_CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    meter = StepMemoryMeter("rss")
    with meter.step():
        pass
    assert meter.last.source == "rss-lifetime"
    assert meter.last.peak_bytes == rss_module.lifetime_peak_rss()
    assert "lifetime" in meter.last.description


def test_format_gib() -> None:
    reading = MemoryReading(peak_bytes=int(0.41 * 2**30), source="tracked")
    assert reading.format_gib() == "0.41 GiB"
    assert reading.format_gib(3) == "0.410 GiB"
    assert MemoryReading(peak_bytes=3 * 2**30, source="cuda").format_gib() == "3.00 GiB"


def test_max_over_ranks_is_identity_without_distributed() -> None:
    reading = MemoryReading(peak_bytes=123, source="tracked", breakdown={"temporaries": 123}, phase="x")
    assert max_over_ranks(reading) is reading
