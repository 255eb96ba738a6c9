"""The planner's throughput calibration: the fit from profiled steps, the file `remat profile --write-calibration`
writes, and its readers (`remat plan --calibration`, ``activation_checkpointing.calibration``), which change the
planner's FLOP/s and so its predicted recompute seconds; a malformed file is one clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from tiny import tiny_recipe

from remat.errors import ConfigError
from remat.planner.calibration import (
    Calibration,
    TimingSample,
    fit_flops_per_second,
    make_calibration,
    read_calibration,
    write_calibration,
)

GIB = 2**30
SMALL = {"preset": "tiny-llama", "config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}}


def test_the_fit_is_extra_time_over_none_against_extra_flops() -> None:
    # none: 1.0 s for 2 TFLOP; full recomputes 0.5 TFLOP in 0.25 s more, attention 0.1 TFLOP in 0.05 s: 2 TFLOP/s.
    samples = [TimingSample("none", 1.0, 2 * 10**12), TimingSample("full", 1.25, 25 * 10**11),
               TimingSample("attention", 1.05, 21 * 10**11), TimingSample("selective", 1.1, 2 * 10**12)]
    fps, method, details = fit_flops_per_second(samples)
    assert method == "recompute-fit"
    assert fps == pytest.approx(2e12)
    assert details["whole_step_flops_per_second"] == pytest.approx(2e12)
    assert [p["label"] for p in details["points"]] == ["full", "attention"]  # selective recomputed no FLOPs


def test_a_fit_without_a_positive_slope_falls_back_to_the_whole_step_and_says_so() -> None:
    samples = [TimingSample("none", 2.0, 4 * 10**12), TimingSample("full", 1.9, 5 * 10**12)]  # noise: faster
    fps, method, details = fit_flops_per_second(samples)
    assert method == "whole-step" and fps == pytest.approx(2e12)
    assert "whole un-checkpointed step" in details["note"]


def test_the_fit_needs_none() -> None:
    with pytest.raises(ConfigError, match=r"--write-calibration: needs 'none' among --policies"):
        fit_flops_per_second([TimingSample("full", 1.0, 10**12)])


def _calibration(fps: float, target: str = "cpu") -> Calibration:
    samples = [TimingSample("none", 1.0, 10**12), TimingSample("full", 1.0 + 10**11 / fps, 11 * 10**11)]
    return make_calibration(samples, device="test device", target=target, torch_version="2.13.0")


def test_a_calibration_round_trips_through_its_file(tmp_path: Path) -> None:
    written = _calibration(1e9)
    path = write_calibration(written, tmp_path / "sub" / "cal.json")
    read = read_calibration(path)
    assert read == written
    assert read.flops_per_second == pytest.approx(1e9) and read.method == "recompute-fit"
    data = json.loads(path.read_text())
    assert {"device", "torch_version", "flops_per_second", "date", "method"} <= set(data)


@pytest.mark.parametrize(("content", "message"), [
    (None, r"does not exist; write one with `remat profile"),
    ("{not json", r"is not JSON"),
    ("[1, 2]", r"holds a list; expected a JSON object"),
    ('{"device": "x"}', r"lacks target, torch_version, flops_per_second, date, method"),
    ("BAD_FPS", r"flops_per_second is -1; allowed: a finite number > 0"),
    ("BAD_TARGET", r"target is 'tpu'; allowed: cuda, cpu"),
    ("BAD_METHOD", r"method is 'guess'; allowed: recompute-fit-by-class, recompute-fit, whole-step"),
])
def test_a_malformed_calibration_is_one_error_naming_the_key(tmp_path: Path, content: str | None,
                                                             message: str) -> None:
    path = tmp_path / "cal.json"
    good = _calibration(1e9).to_dict()
    edits: dict[str, dict[str, Any]] = {"BAD_FPS": {"flops_per_second": -1}, "BAD_TARGET": {"target": "tpu"},
                                        "BAD_METHOD": {"method": "guess"}}
    if content in edits:
        path.write_text(json.dumps({**good, **edits[content]}))
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=r"^distributed.planner_calibration: '.*cal.json'.*" + message):
        read_calibration(path, key="distributed.planner_calibration")


def test_a_fifo_or_a_huge_file_as_the_calibration_is_one_line_not_a_hang(tmp_path: Path) -> None:
    import os

    from processes import within

    fifo = tmp_path / "cal.json"
    os.mkfifo(fifo)
    with within(10), pytest.raises(ConfigError, match=r"^--calibration '.*cal.json' is a FIFO \(named pipe\); "
                                                       r"allowed: a regular file"):
        read_calibration(fifo)
    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (2 << 20))
    with pytest.raises(ConfigError, match=r"holds 2,097,152 bytes; allowed: at most 1,048,576"):
        read_calibration(huge)


def _recipe(tmp_path: Path, **distributed: Any) -> Path:
    recipe = tiny_recipe(output_dir=str(tmp_path / "run"), model=SMALL, dataset={"seq_length": 64},
                         step_scheduler={"global_batch_size": 2, "max_steps": 2}, checkpoint={"enabled": False},
                         logging={"metrics_file": None},
                         distributed={"activation_checkpointing": "auto", **distributed})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_a_calibration_changes_the_planners_throughput_and_predicted_times(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main
    from remat.planner.api import planner_for_recipe
    from remat.recipes.loader import load_recipe

    cal = write_calibration(_calibration(1e9), tmp_path / "cal.json")
    default = planner_for_recipe(load_recipe(_recipe(tmp_path)))
    calibrated = planner_for_recipe(load_recipe((
        _recipe(tmp_path, planner_calibration=str(cal)))))
    assert default.flops_per_second == 5e10
    assert calibrated.flops_per_second == pytest.approx(1e9)
    none_peak = default.uniform_candidates(GIB)[0].peak_bytes
    budget = none_peak * 9 // 10  # forces some recompute
    before, after = default.plan(budget), calibrated.plan(budget)
    assert before.policy == after.policy and before.recompute_flops == after.recompute_flops > 0
    assert after.recompute_seconds == pytest.approx(before.recompute_seconds * 50)  # 5e10 / 1e9

    out = tmp_path / "plan.json"
    assert main(["plan", str(_recipe(tmp_path)), "--budget", str(budget), "--calibration", str(cal), "--json",
                 str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["flops_per_second"] == pytest.approx(1e9)
    assert report["budgets"][0]["recompute_seconds"] == pytest.approx(after.recompute_seconds)
    capsys.readouterr()


def test_a_calibration_for_the_other_target_or_a_broken_one_is_refused(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main
    from remat.planner import plan_recipe_auto
    from remat.recipes.loader import load_recipe

    gpu = write_calibration(_calibration(4e14, target="cuda"), tmp_path / "gpu.json")
    with pytest.raises(ConfigError, match=r"distributed.activation_checkpointing.calibration: '.*gpu.json' was "
                                          r"measured on cuda "
                                          r"\(test device\) but this plan is for cpu"):
        plan_recipe_auto(load_recipe(_recipe(tmp_path, planner_calibration=str(gpu), memory_budget="1GiB")))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert main(["plan", str(_recipe(tmp_path)), "--budget", "1GiB", "--calibration", str(broken)]) == 2
    assert "error: --calibration: " in capsys.readouterr().err
    assert main(["plan", str(_recipe(tmp_path)), "--budget", "1GiB", "--calibration", str(gpu),
                 "--flops-per-second", "1e9"]) == 2
    assert "give it or --flops-per-second, not both" in capsys.readouterr().err


def test_a_calibration_by_op_class_reaches_the_planner_from_the_recipe_and_the_command_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`remat profile --write-calibration` fits a memory-bound rate when the steps' bytes tell it apart
    (tests/planner/test_timing.py); the recipe's calibration and ``remat plan --calibration`` price with it."""
    from remat.cli import main
    from remat.planner.api import planner_for_recipe
    from remat.recipes.loader import load_recipe

    calibration = Calibration(device="test", target="cpu", torch_version="2.13.0", flops_per_second=1e10,
                              date="2026-11-28", method="recompute-fit-by-class", memory_bytes_per_second=2e9)
    cal = write_calibration(calibration, tmp_path / "cal.json")
    planner = planner_for_recipe(load_recipe(_recipe(tmp_path, planner_calibration=str(cal))))
    assert (planner.rates.flops_per_second, planner.rates.memory_bytes_per_second) == (1e10, 2e9)
    budget = planner.uniform_candidates(GIB)[0].peak_bytes * 9 // 10
    plan = planner.plan(budget)
    assert plan.rates is not None and plan.recompute_cost > plan.recompute_flops  # memory-bound work priced too
    out = tmp_path / "plan.json"
    assert main(["plan", str(_recipe(tmp_path)), "--budget", str(budget), "--calibration", str(cal), "--json",
                 str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rates_per_second"]["memory_bytes_per_second"] == 2e9
    assert report["budgets"][0]["recompute_cost"] == pytest.approx(plan.recompute_cost, rel=1e-4)
    assert "recompute s" in capsys.readouterr().out
