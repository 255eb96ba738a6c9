"""What ``remat estimate --longest --compare`` costs, counted rather than timed.

Nearly all of its time is the simulated steps themselves (see benchmarks/results/longest.md): one fake-model build,
one training step on fake tensors and one allocator replay per estimate. So the speed-relevant structure is the
number of estimates and how they are batched, which these tests pin down for the Llama-3.2-1B run of
benchmarks/bench_longest.py (with the simulation replaced by lines like the recorded ones) and per estimate on the
tiny model: a change that adds estimates, simulates a (settings, length) twice, splits the first batch (idle
workers) or builds / replays more than once per estimate fails here.
"""

from __future__ import annotations

import pytest

from remat.cli import main
from remat.estimate import sampling
from remat.estimate.sampling import PeakSample, PeakSampler, sample_peak
from remat.estimate.settings import StepSettings

GiB, KiB = 2**30, 2**10

# (fixed GiB, KiB per token) of the binding phase per row, as benchmarks/results/longest.md records them.
RECORDED_LINES: dict[str, tuple[float, float]] = {
    "none + plain": (6.90, 3218.0), "none + fused": (7.40, 1746.4),
    "selective + plain": (6.91, 2049.3), "selective + fused": (7.43, 647.3),
    "full + plain": (6.91, 1583.3), "full + fused": (7.43, 206.4),
    "full + tiled + fused": (7.50, 108.5), "full + tiled + offload + fused": (9.02, 55.5),
}
CLI = ["estimate", "--preset", "llama-3.2-1b", "--batch-size", "1", "--dtype", "bfloat16", "--longest", "--fits",
       "80GiB", "--compare", "--jobs", "1"]


_DESCRIBED_AS = {"full, tiled (auto tokens) + fused": "full + tiled + fused",
                 "full, inputs offloaded, tiled (auto tokens) + fused": "full + tiled + offload + fused"}


def _label(settings: StepSettings) -> str:
    """The --compare row label of ``settings`` (the tiled rows describe themselves at more length)."""
    described = settings.describe()
    return _DESCRIBED_AS.get(described, described)


def _expected_answer(label: str) -> int:
    fixed, per_token = RECORDED_LINES[label]
    granularity = 2048 if "tiled" in label else 1024  # the tile length (the hidden size) with tiling
    return int((80 * GiB - fixed * GiB) / (per_token * KiB)) // granularity * granularity


def test_compare_run_makes_each_estimate_once_in_one_first_batch(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    asked: list[tuple[str, int]] = []
    batches: list[int] = []

    def fake(model: object, settings: StepSettings, seq_length: int) -> PeakSample:
        fixed, per_token = RECORDED_LINES[_label(settings)]
        peak = int(fixed * GiB + per_token * KiB * seq_length)
        asked.append((_label(settings), seq_length))
        return PeakSample(seq_length, peak, "backward", {"backward": peak}, 0.0)

    original_many = PeakSampler.many

    def many(self: PeakSampler, requests):  # type: ignore[no-untyped-def]
        batches.append(len({(id(s), n) for s, n in requests if (id(s), n) not in self._done}))
        return original_many(self, requests)

    monkeypatch.setattr(sampling, "sample_peak", fake)
    monkeypatch.setattr(PeakSampler, "many", many)
    assert main(CLI) == 0
    out = capsys.readouterr().out

    assert len(asked) == len(set(asked)) == 27  # 8 rows x 3 window lengths, and one row sampled again below
    window = (32768, 40960, 49152)
    assert sorted(asked[:24]) == sorted((label, n) for label in RECORDED_LINES for n in window)
    assert asked[24:] == [("none + plain", n) for n in (5120, 10240, 15360)]
    assert batches[0] == 24 and sum(batches) == 27  # the first windows of every row go to the workers at once
    for label in RECORDED_LINES:  # and the answers are the lines' (the none + plain one from its lower window)
        row = next(line for line in out.splitlines() if line.startswith(label + "  "))
        assert f"{_expected_answer(label):,}" in row, row


def test_one_estimate_is_one_build_one_step_and_one_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.estimate import replay as replay_module
    from remat.estimate import simulate
    from remat.estimate.api import resolve_model

    counts = {"build": 0, "step": 0, "replay": 0}

    def counting(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(simulate, "build_fake_model", counting("build", simulate.build_fake_model))
    monkeypatch.setattr(simulate, "train_step", counting("step", simulate.train_step))
    monkeypatch.setattr(replay_module, "replay", counting("replay", replay_module.replay))
    model = resolve_model("tiny-llama")
    settings = StepSettings(policy={"mode": "full", "tiled": True, "tile_tokens": 128}, loss="fused", dtype="float32")
    sample = sample_peak(model, settings, 256)
    assert counts == {"build": 1, "step": 1, "replay": 1}
    assert sample.peak_bytes == max(sample.phase_peaks.values()) > 0
