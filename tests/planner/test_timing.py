"""The planner minimises predicted seconds, not FLOPs: recompute is counted by op class on fake tensors (matmul and
attention FLOPs, bytes written by memory-bound ops) and priced at per-class rates (`remat.planner.timing`) that
`remat profile --write-calibration` fits. Without class rates the cost is the FLOPs and the plans are unchanged
(tests/planner/test_plans_unchanged.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.errors import ConfigError
from remat.estimate.settings import StepSettings
from remat.models import ModelConfig
from remat.planner.calibration import TimingSample, fit_by_class, make_calibration, read_calibration, \
    write_calibration
from remat.planner.choose import total_cost
from remat.planner.planner import Planner
from remat.planner.timing import RecomputeRates

MODEL = ModelConfig(preset="tiny-llama")
STEP = StepSettings(batch_size=2, seq_length=256, target="cpu")
SLOW_MEMORY = 1e8  # bytes/s: memory-bound recompute dominates


@pytest.fixture(scope="module")
def planners() -> tuple[Planner, Planner]:
    return Planner.from_settings(MODEL, STEP), Planner.from_settings(MODEL, STEP, memory_bytes_per_second=SLOW_MEMORY)


def test_recompute_is_counted_by_op_class(planners: tuple[Planner, Planner]) -> None:
    kind = planners[0].measurements.kinds[0]
    none, selective, full, attention = (kind.cost(mode) for mode in ("none", "selective", "full", "attention"))
    assert (none.recompute_flops, none.recompute_attention_flops, none.recompute_memory_bytes) == (0, 0, 0)
    # full recomputes the whole forward: every class, attention's FLOPs among its FLOPs
    assert 0 < full.recompute_attention_flops < full.recompute_flops and full.recompute_memory_bytes > 0
    assert attention.recompute_attention_flops == full.recompute_attention_flops
    # selective keeps the matmul outputs: it recomputes far fewer FLOPs than full, but most of its memory-bound work
    assert selective.recompute_flops < full.recompute_flops / 2
    assert selective.recompute_memory_bytes > full.recompute_memory_bytes / 2


def test_the_fastest_plan_is_chosen_even_when_another_recomputes_fewer_flops(
        planners: tuple[Planner, Planner]) -> None:
    by_flops, by_time = planners
    peaks = {c.label: c.peak_bytes for c in by_flops.uniform_candidates(2**40)}
    budget = (peaks["none"] + peaks["full"]) // 2
    fewest_flops, fastest = by_flops.plan(budget), by_time.plan(budget)
    assert fewest_flops.peak_bytes <= budget and fastest.peak_bytes <= budget
    assert fastest.policy != fewest_flops.policy
    assert fastest.recompute_flops > fewest_flops.recompute_flops  # more FLOPs ...
    modes = tuple(block.mode for block in fewest_flops.blocks)
    slow_seconds_of_fewest = by_time.rates.seconds(total_cost(modes, by_time.measurements, by_time.rates.cost_of))
    assert fastest.recompute_seconds < slow_seconds_of_fewest  # ... in less time at these rates
    assert fastest.rates == RecomputeRates(by_time.rates.flops_per_second, memory_bytes_per_second=SLOW_MEMORY)
    assert "memory-bound ops 0.1 GB/s" in fastest.summary()
    assert fewest_flops.rates is None and fewest_flops.recompute_cost == fewest_flops.recompute_flops


def test_without_class_rates_the_cost_is_the_flops() -> None:
    rates = RecomputeRates(2e12)
    assert not rates.by_class and rates.cost(10**9, 10**8, 10**9) == 10**9
    both = RecomputeRates(2e12, attention_flops_per_second=1e12, memory_bytes_per_second=1e12)
    # 1e9 FLOPs of which 1e8 attention at half the rate (1e8 more equivalents), 1e9 bytes at 2 FLOP-equivalents each
    assert both.cost(10**9, 10**8, 10**9) == 10**9 + 10**8 + 2 * 10**9
    assert both.seconds(both.cost(10**9)) == pytest.approx(0.5e-3)
    with pytest.raises(ConfigError, match=r"^memory_bytes_per_second: got -1; allowed: a finite number > 0$"):
        RecomputeRates(1e12, memory_bytes_per_second=-1)


def test_the_calibration_fits_both_rates_from_profiled_steps(tmp_path: Path) -> None:
    flops_rate, bytes_rate = 2e12, 5e11

    def sample(label: str, flops: int, nbytes: int) -> TimingSample:
        return TimingSample(label, 1.0 + flops / flops_rate + nbytes / bytes_rate, 10**13 + flops,
                            10**11 + nbytes)

    samples = [sample("none", 0, 0), sample("selective", 10**11, 4 * 10**10), sample("full", 10**12, 5 * 10**10),
               sample("attention", 3 * 10**11, 10**10)]
    assert fit_by_class(samples) == (pytest.approx(flops_rate), pytest.approx(bytes_rate))
    calibration = make_calibration(samples, device="test", target="cpu", torch_version="2.13.0")
    assert calibration.method == "recompute-fit-by-class"
    assert "2 TFLOP/s, memory-bound ops 500 GB/s on test" in calibration.describe()
    assert calibration.memory_bytes_per_second == pytest.approx(bytes_rate)
    read = read_calibration(write_calibration(calibration, tmp_path / "cal.json"))
    assert read.memory_bytes_per_second == pytest.approx(bytes_rate)
    # bytes not counted (an older profile): the one-number fit, and no memory rate
    old = [TimingSample(s.label, s.median_step_s, s.step_flops) for s in samples]
    assert fit_by_class(old) is None
    assert make_calibration(old, device="test", target="cpu", torch_version="2.13.0").memory_bytes_per_second is None
