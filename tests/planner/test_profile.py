"""`remat profile`: the settings it accepts, the side-by-side table, and a real CPU run of the quick start (tiny
overrides) producing the table, JSON, PNG and a calibration with sane values."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from remat.errors import ConfigError
from remat.recipes.loader import load_recipe
from remat.planner.profile import PlanSummary, ProfileReport, SettingResult, parse_settings

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
#: The quick start made small, on the CPU: one micro-batch of 4 x 128 tokens per step (activations still outweigh
#: the rest).
TINY = ["--step_scheduler.local_batch_size", "4", "--step_scheduler.global_batch_size", "4",
        "--dataset.seq_length", "128", "--validation_dataset.seq_length", "128", "--logging.progress", "plain",
        "--distributed.device", "cpu"]


def test_settings_are_the_recipe_spellings_plus_auto_per_budget() -> None:
    settings = parse_settings("none, Selective,full,auto", ["15GiB", "20GiB"])
    assert [s.label for s in settings] == ["none", "selective", "full", "auto@15GiB", "auto@20GiB"]
    assert settings[1].policy is not None and settings[1].policy.mode == "selective"
    assert [s.budget for s in settings if s.is_auto] == ["15GiB", "20GiB"]
    assert [s.label for s in parse_settings("sqrt,auto", ["1GiB"])] == ["sqrt", "auto"]
    assert parse_settings(["true", "mlp"])[0].policy.mode == "full"  # type: ignore[union-attr]
    mixed = parse_settings("none,{mode: full, every_n_layers: 2},{mode: selective, layers: {0-1: full}}")
    assert [s.label for s in mixed] == ["none", "full, every 2nd block", "selective, per-layer: 0-1=full"]
    assert mixed[1].policy is not None and mixed[1].policy.every_n_layers == 2


@pytest.mark.parametrize(("policies", "budgets", "message"), [
    ("none,fulll", [], r"--policies: got 'fulll'; allowed: true, false, full, none, selective, attention, mlp, "
                       r"offload, sqrt \(did you mean 'full'\?\); or auto"),
    (" , ", [], r"--policies: empty; allowed: a comma-separated list of true, false, .*auto"),
    ("full,none,full", [], r"--policies: full given more than once"),
    ("none,full", ["20GiB"], r"--budget: only 'auto' is planned for a budget"),
    ("none,{mode: ful}", [], r"--policies.mode: got 'ful'"),
    ("{mode: [}", [], r"--policies: '\{mode: \[\}' is not a YAML mapping"),
])
def test_bad_settings_are_one_clear_error(policies: str, budgets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_settings(policies, budgets)


def _result(label: str, times: list[float], peaks: list[int], flops: int, **extra: object) -> SettingResult:
    return SettingResult(label, policy={"mode": label}, policy_text=label, step_times_s=times, peak_bytes=peaks,
                         losses=[2.0] * len(times), tokens_per_step=1000, step_flops=flops, memory_source="tracked",
                         **extra)  # type: ignore[arg-type]


def test_the_table_gives_medians_after_warmup_and_ratios_to_none() -> None:
    plan = PlanSummary(budget_bytes=3 * 2**30, policy="selective", predicted_peak_bytes=int(2.5 * 2**30),
                       predicted_recompute_flops=10**11)
    report = ProfileReport(recipe="r.yaml", device="cpu", target="cpu", torch_version="2.13", steps=4, warmup=1,
                           results=[
                               _result("none", [9.0, 1.0, 2.0, 1.5], [1, 4 * 2**30, 4 * 2**30, 4 * 2**30], 10**12),
                               _result("full", [9.0, 2.0, 3.0, 2.5], [1, 2**30, 2**30, 2**30], 13 * 10**11),
                               _result("auto", [9.0, 1.5, 1.8, 1.8], [1, 3 * 2**30, 3 * 2**30, 3 * 2**30],
                                       11 * 10**11, plan=plan),
                               SettingResult("auto@1MiB", error="nothing fits"),
                           ])
    none, full, auto, failed = report.results
    assert none.median_step_s == 1.5 and none.peak == 4 * 2**30 and none.tokens_per_s == pytest.approx(1000 / 1.5)
    assert not failed.ok
    text = report.table()
    rows = {line.split()[0]: line.split() for line in text.splitlines()[2:6]}
    assert rows["none"][2:6] == ["4.000", "1.000", "1.5000", "1.000"]
    assert rows["full"][2:] == ["1.000", "0.250", "2.5000", "1.667", "400", "1.3", "1.300"]
    assert rows["auto@1MiB"][2:] == ["-"] * 7
    assert ("auto: planned for 3.000 GiB: selective; predicted peak 2.500 GiB (measured 3.000), predicted recompute "
            "0.1 TFLOP (counted 0.1)") in text
    assert "auto@1MiB: nothing fits" in text
    assert report.loss_difference() == 0.0
    two_rounds = SettingResult("full", warmup=1, steps_per_round=3, step_times_s=[9.0, 1.0, 2.0, 8.0, 4.0, 3.0],
                               peak_bytes=[9, 1, 2, 9, 4, 3])
    assert two_rounds.timed(two_rounds.step_times_s) == [1.0, 2.0, 4.0, 3.0]
    assert two_rounds.median_step_s == 2.5 and two_rounds.peak == 4  # each round's warm-up step left out
    samples = {s.label: s for s in report.samples()}
    assert set(samples) == {"none", "full", "auto"} and samples["full"].median_step_s == 2.5


def test_remat_profile_on_the_cpu_gives_table_json_png_and_calibration(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from remat.checkpointing import CheckpointPolicy
    from remat.cli import main
    from remat.planner.api import planner_for_recipe
    from remat.planner.calibration import read_calibration

    planner = planner_for_recipe(load_recipe(QUICKSTART, TINY), target="cpu")
    none, full = (planner.estimate(CheckpointPolicy(mode=mode)).peak_bytes for mode in ("none", "full"))
    budget = full + (none - full) // 2
    out, png, cal = tmp_path / "profile.json", tmp_path / "profile.png", tmp_path / "cal.json"
    code = main(["profile", str(QUICKSTART), "--policies", "none,full,auto", "--budget", str(budget), "--budget",
                 "1MiB", "--steps", "2", "--rounds", "2", "--json", str(out), "--png", str(png),
                 "--write-calibration", str(cal), "--workdir", str(tmp_path / "runs"), *TINY])
    printed = capsys.readouterr().out
    assert code == 1, printed  # nothing fits 1 MiB: that setting has no figures, the others ran
    assert re.search(r"^setting +policy +peak GiB +x none +median step s", printed, flags=re.M)
    assert f"auto@{budget}: planned for" in printed and "calibration: " in printed
    assert f"profile [3/4, round 2/2] auto@{budget}" in printed  # progress, one line per setting and round
    assert "profile [4/4, round 1/2] auto@1MiB: distributed.activation_checkpointing.memory_budget: nothing fits 1.00 MiB" in printed
    assert re.search(r"^auto@1MiB +- +- +-", printed, flags=re.M)

    report = json.loads(out.read_text())
    assert report["target"] == "cpu" and report["torch_version"] == torch.__version__
    assert report["steps"] == 2 and report["rounds"] == 2 and report["warmup_steps"] == 1
    by_label = {s["label"]: s for s in report["settings"]}
    assert list(by_label) == ["none", "full", f"auto@{budget}", "auto@1MiB"]
    assert "nothing fits" in by_label.pop("auto@1MiB")["error"]
    for s in by_label.values():
        assert len(s["step_times_s"]) == 4 and s["memory_source"] == "tracked"  # 2 rounds of 2 steps
        assert s["peak_bytes"] == max(s["step_peak_bytes"][1], s["step_peak_bytes"][3]) > 0
        assert s["median_step_s"] == pytest.approx((s["step_times_s"][1] + s["step_times_s"][3]) / 2, abs=2e-6)
        assert s["losses"][:2] == s["losses"][2:]  # each round starts afresh from the same seed
        assert s["tokens_per_step"] == 4 * 128
        assert s["tokens_per_s"] == pytest.approx(512 / s["median_step_s"], rel=1e-3)
    n, f, a = by_label["none"], by_label["full"], by_label[f"auto@{budget}"]
    assert n["peak_bytes"] > a["peak_bytes"] > f["peak_bytes"]
    assert a["peak_bytes"] <= budget == a["plan"]["budget_bytes"]
    # Full recomputes every block's forward: more FLOPs than none, less than twice them.
    assert n["step_flops"] < a["step_flops"] < f["step_flops"] < 2 * n["step_flops"]
    # What the planner predicted auto would recompute is what the real step counted.
    assert a["step_flops"] - n["step_flops"] == a["plan"]["predicted_recompute_flops"]
    assert report["loss_difference"] == pytest.approx(0.0, abs=1e-6)
    assert n["losses"] == pytest.approx(f["losses"], abs=1e-6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    calibration = read_calibration(cal)
    assert calibration.target == "cpu" and calibration.torch_version == torch.__version__
    assert calibration.method in ("recompute-fit-by-class", "recompute-fit", "whole-step")
    assert calibration.flops_per_second > 0
    assert calibration.details["baseline_step_flops"] == n["step_flops"]
    assert n["step_memory_bytes"] > 0  # the first step counted by op class (memory-bound bytes written)
    if calibration.method == "recompute-fit-by-class":  # CPU timings decide which fit holds: both rates positive
        assert calibration.memory_bytes_per_second is not None and calibration.memory_bytes_per_second > 0
    else:
        assert calibration.memory_bytes_per_second is None


def test_write_calibration_without_none_is_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main

    assert main(["profile", str(QUICKSTART), "--policies", "full", "--write-calibration", "x.json"]) == 2
    assert "error: --write-calibration: needs none among --policies" in capsys.readouterr().err


def test_a_budget_that_is_no_size_stops_before_any_step(capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main

    assert main(["profile", str(QUICKSTART), "--policies", "none,auto", "--budget", "20 bananas", *TINY]) == 2
    captured = capsys.readouterr()
    assert "error: --budget: " in captured.err and "profile [1/2]" not in captured.out


@pytest.mark.slow
def test_a_recipe_that_compiles_its_blocks_is_profiled_compiled_and_not_counted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """NOTE [ A counted step is never compiled ]: counting the first step would make dynamo run every later step's
    blocks eagerly; a compiled recipe's steps are timed with their blocks compiled, and not counted."""
    from torch._dynamo.utils import counters

    from remat.cli import main

    torch._dynamo.reset()
    counters.clear()
    out = tmp_path / "profile.json"
    compiled = ["--compile.enabled", "true", "--compile.backend", "aot_eager"]
    assert main(["profile", str(QUICKSTART), "--policies", "none,full", "--steps", "2", "--json", str(out),
                 "--workdir", str(tmp_path / "runs"), *TINY, *compiled]) == 0
    assert "profile: compile: the steps are timed, not counted" in capsys.readouterr().out
    assert counters["stats"]["unique_graphs"] >= 2  # each policy's blocks compiled
    settings = json.loads(out.read_text())["settings"]
    assert all(s["step_flops"] == 0 and s["median_step_s"] > 0 for s in settings)
    torch._dynamo.reset()
    assert main(["profile", str(QUICKSTART), "--policies", "none,full", "--write-calibration",
                 str(tmp_path / "cal.json"), *TINY, *compiled]) == 2
    assert "error: --write-calibration: the recipe compiles its blocks" in capsys.readouterr().err
