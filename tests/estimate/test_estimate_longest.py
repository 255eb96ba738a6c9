"""``remat estimate --longest``: the longest sequence whose predicted peak fits, from lines fitted per phase.

The line fitting and solving are checked on made-up samples; the search on the tiny model (CPU target, short
lengths) against direct estimates at the answer and one granularity step beyond it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat.cli import main
from remat.errors import ConfigError
from remat.estimate import longest as longest_module
from remat.estimate.api import resolve_model
from remat.estimate.longest import find_longest, fit_lines, solve
from remat.estimate.sampling import PeakSample
from remat.estimate.settings import StepSettings

MiB = 2**20


def _sample(n: int, **phases: float) -> PeakSample:
    peaks = {name.replace("_", " "): int(value) for name, value in phases.items()}
    return PeakSample(n, max(peaks.values()), max(peaks, key=peaks.__getitem__), peaks, 0.0)


def _lines(fixed: dict[str, float], slope: dict[str, float], lengths: tuple[int, ...] = (1000, 1250, 1500)):
    return [_sample(n, **{p: fixed[p] + slope[p] * n for p in fixed}) for n in lengths]


def test_lines_are_fitted_per_phase_and_the_steepest_reaching_the_budget_binds() -> None:
    samples = _lines({"forward": 100 * MiB, "backward": 50 * MiB, "optimizer_step": 300 * MiB},
                     {"forward": 1000, "backward": 3000, "optimizer_step": 0})
    lines = {ln.phase: ln for ln in fit_lines(samples)}
    assert lines["backward"].bytes_per_token == pytest.approx(3000)
    assert lines["forward"].fixed_bytes == pytest.approx(100 * MiB)
    assert all(ln.deviation_bytes == pytest.approx(0, abs=1) for ln in lines.values())
    length, phase = solve(list(lines.values()), 1000 * MiB)
    assert phase == "backward" and length == pytest.approx((1000 * MiB - 50 * MiB) / 3000)


def test_a_flat_phase_above_the_budget_means_nothing_fits() -> None:
    lines = fit_lines(_lines({"forward": 10 * MiB, "optimizer_step": 900 * MiB}, {"forward": 10, "optimizer_step": 0}))
    assert solve(lines, 800 * MiB) == (None, "optimizer step")


def test_a_kink_shows_as_a_deviation() -> None:
    samples = _lines({"backward": 0}, {"backward": 1000})
    samples[0] = _sample(1000, backward=500 * MiB)  # a constant moment dominates the shortest sample
    (line,) = fit_lines(samples)
    assert line.deviation_bytes > 400 * MiB


@pytest.fixture(scope="module")
def tiny() -> object:
    return resolve_model("tiny-llama")


def test_the_extrapolated_answer_is_confirmed_by_direct_estimates(tiny: object) -> None:
    """Past the loss's chunk cap the step is affine in the length: the extrapolated answer is the direct one."""
    settings = StepSettings(policy="full", loss="fused", target="cpu")
    capacity = 200 * MiB
    (plain,) = find_longest(tiny, [("full", settings)], capacity, window_start=4096, granularity=256)
    (checked,) = find_longest(tiny, [("full", settings)], capacity, window_start=4096, granularity=256, confirm=True)
    assert plain.method == "extrapolated" and plain.collinear and plain.seq_length % 256 == 0
    assert checked.method == "confirmed" and checked.seq_length == plain.seq_length
    direct = {s.seq_length: s.peak_bytes for s in checked.direct}
    assert direct[checked.seq_length] <= capacity < direct[checked.seq_length + 256]
    assert plain.predicted_peak_bytes == pytest.approx(direct[plain.seq_length], abs=2 * MiB)
    assert [s.seq_length for s in plain.samples] == [4096, 5120, 6144]
    payload = plain.to_dict()
    assert payload["longest_seq_length"] == plain.seq_length and payload["settings"]["policy"] == "full"


def test_a_setting_the_estimate_does_not_model_is_answered_with_the_reason(tiny: object, monkeypatch) -> None:
    from remat.estimate import simulate

    def refuse(recipe, run):  # type: ignore[no-untyped-def]
        raise ConfigError("distributed.activation_checkpointing: not modelled here")

    monkeypatch.setattr(simulate, "check_simulable", refuse)
    (answer,) = find_longest(tiny, [("x", StepSettings(policy="full", target="cpu"))], 200 * MiB)
    assert answer.seq_length is None and answer.method == "not modelled"
    assert answer.reason == "distributed.activation_checkpointing: not modelled here"
    assert answer.to_dict()["longest_seq_length"] is None


def test_tiled_granularity_and_window_follow_the_tile(tiny: object) -> None:
    settings = StepSettings(policy={"mode": "full", "tiled": True, "tile_tokens": 3000}, loss="fused")
    assert longest_module._granularity(tiny, settings, None) == 3000
    assert longest_module._window(tiny, settings, 3000, None) == (48000, 60000, 72000)  # 16 tiles and more
    assert longest_module._granularity(tiny, StepSettings(policy="full"), None) == 1024
    with pytest.raises(ConfigError, match="--granularity: got 0"):
        longest_module._granularity(tiny, settings, 0)


def test_cli_longest_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--longest"], "--longest: needs --fits"),
        (["--confirm", "--fits", "1GiB"], "--confirm: only with --longest"),
        (["--longest", "--fits", "1GiB", "--seq-length", "4096"], "--seq-length: --longest searches"),
        (["--longest", "--fits", "1GiB", "--jobs", "0"], "--jobs: got 0"),
    ):
        assert main(["estimate", "--preset", "tiny-llama", *argv]) != 0
        assert message in capsys.readouterr().err


def test_cli_longest_compare_rows_add_the_tiled_settings() -> None:
    from remat.commands.estimate_longest import longest_rows

    base = StepSettings()
    rows = [(f"{p} + {loss}", StepSettings(policy=p, loss=loss)) for p in ("none", "full") for loss in ("plain", "fused")]
    rows.append(("policy=sqrt", base))
    out = longest_rows(rows, 4)
    assert [label for label, _ in out] == ["none + plain", "none + fused", "full + plain", "full + fused",
                                           "full + tiled + fused", "full + tiled + offload + fused", "policy=sqrt"]
    assert out[4][1].policy == {"mode": "full", "tiled": True} and out[4][1].loss == "fused"
    assert out[5][1].policy == {"mode": "full", "tiled": True, "offload": True}


def test_cli_longest_writes_each_settings_longest_length(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "longest.json"
    code = main(["estimate", "--preset", "tiny-llama", "--target", "cpu", "--loss", "fused", "--policy", "full",
                 "--longest", "--fits", "200MiB", "--window-start", "4096", "--granularity", "256", "--jobs", "1",
                 "--json", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    assert payload["method"] == "extrapolated" and payload["longest_seq_length"] > 4096
    assert f"{payload['longest_seq_length']:,}" in capsys.readouterr().out


def _fake_curve(monkeypatch: pytest.MonkeyPatch, peak_of: object) -> list[int]:
    """Replace the simulation by ``peak_of(seq_length)`` (one phase); returns the lengths asked for."""
    from remat.estimate import sampling

    asked: list[int] = []

    def fake(model: object, settings: object, seq_length: int) -> PeakSample:
        asked.append(seq_length)
        peak = int(peak_of(seq_length))  # type: ignore[operator]
        return PeakSample(seq_length, peak, "backward", {"backward": peak}, 0.0)

    monkeypatch.setattr(sampling, "sample_peak", fake)
    return asked


def test_a_curve_that_is_not_affine_falls_back_to_bisection(tiny: object, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _fake_curve(monkeypatch, lambda n: 100 * MiB + 16 * n * n)  # quadratic: a dense [T, T] mask
    capacity = 2048 * MiB
    (answer,) = find_longest(tiny, [("dense", StepSettings(target="cpu"))], capacity, window_start=4096,
                             granularity=512)
    exact = max(n for n in range(512, 200_000, 512) if 100 * MiB + 16 * n * n <= capacity)
    assert answer.method == "bisection" and answer.seq_length == exact
    assert any("not collinear" in note for note in answer.notes)
    assert asked[:6] == [4096, 5120, 6144, 8192, 10240, 12288]  # the window, then the doubled window


def test_math_attention_goes_to_bisection_at_once_and_says_why(tiny: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.estimate import sampling

    asked: list[int] = []

    def fake(model: object, settings: object, seq_length: int) -> PeakSample:
        asked.append(seq_length)
        peak = 100 * MiB + 16 * seq_length * seq_length  # the math kernel's [T, T] scores
        return PeakSample(seq_length, peak, "backward", {"backward": peak}, 0.0, {"math": 16})

    monkeypatch.setattr(sampling, "sample_peak", fake)
    capacity = 2048 * MiB
    (answer,) = find_longest(tiny, [("fp32", StepSettings(target="cpu"))], capacity, window_start=4096,
                             granularity=512)
    assert answer.method == "bisection"
    assert answer.seq_length == max(n for n in range(512, 200_000, 512) if 100 * MiB + 16 * n * n <= capacity)
    assert asked[3:6] != [8192, 10240, 12288]  # no doubled window: a longer one is no straighter
    assert any("math kernel" in note and "--dtype" in note for note in answer.notes)


def test_an_answer_below_the_window_is_sampled_again_below_it(tiny: object, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _fake_curve(monkeypatch, lambda n: 50 * MiB + 4096 * n)
    (answer,) = find_longest(tiny, [("steep", StepSettings(target="cpu"))], 100 * MiB, window_start=32768)
    assert answer.method == "extrapolated" and answer.seq_length == (50 * MiB) // 4096 // 1024 * 1024
    assert asked[3:] == [3072, 6144, 9216] and "sampled again below it" in answer.notes[0]


def test_confirm_corrects_an_extrapolation_that_was_too_long(tiny: object, monkeypatch: pytest.MonkeyPatch) -> None:
    # affine over the window, steeper beyond 20,000 tokens (a moment the window never sees)
    _fake_curve(monkeypatch, lambda n: 10 * MiB + 1000 * n + (3000 * (n - 20_000) if n > 20_000 else 0))
    capacity = 100 * MiB
    (plain,) = find_longest(tiny, [("kink", StepSettings(target="cpu"))], capacity, window_start=4096)
    (checked,) = find_longest(tiny, [("kink", StepSettings(target="cpu"))], capacity, window_start=4096, confirm=True)
    exact = max(n for n in range(1024, 200_000, 1024)
                if 10 * MiB + 1000 * n + (3000 * (n - 20_000) if n > 20_000 else 0) <= capacity)
    assert plain.method == "extrapolated" and plain.seq_length > exact  # the documented error of extrapolation
    assert checked.method == "corrected" and checked.seq_length == exact


def test_a_row_refused_when_run_is_answered_with_the_reason_and_the_others_go_on(
        tiny: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.errors import CheckpointingError
    from remat.estimate import sampling

    def fake(model: object, settings: StepSettings, seq_length: int) -> PeakSample:
        if settings.policy != "full":
            raise CheckpointingError("tiled: model.layers.0 is a mixture-of-experts block; remove tiled")
        peak = 10 * MiB + 1000 * seq_length
        return PeakSample(seq_length, peak, "backward", {"backward": peak}, 0.0)

    monkeypatch.setattr(sampling, "sample_peak", fake)
    rows = [("tiled", StepSettings(policy={"mode": "full", "tiled": True, "tile_tokens": 1024}, target="cpu")),
            ("full", StepSettings(policy="full", target="cpu"))]
    refused, full = find_longest(tiny, rows, 100 * MiB, window_start=4096)
    assert refused.method == "refused" and refused.seq_length is None and "mixture-of-experts" in refused.reason
    assert full.method == "extrapolated" and full.seq_length == (90 * MiB) // 1000 // 1024 * 1024
