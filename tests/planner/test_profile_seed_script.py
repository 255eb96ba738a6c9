"""benchmarks/profile_seed_cuda.py, the GPU acceptance run of `remat profile`: its arguments, command and verdicts
on the CPU (the run itself needs a GPU and refuses clearly without one)."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from types import ModuleType

import pytest
import torch


@pytest.fixture
def script(benchmark_script: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_script("profile_seed_cuda")


def test_the_dry_run_prints_the_seed_profile_command(script: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert script.main(["--dry-run", "--out", "res", "--logging.progress", "plain"]) == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[:3] == ["remat", "profile", str(script.RECIPE)]
    assert argv[argv.index("--policies") + 1] == ("none,attention,mlp,selective,full,{mode: full, every_n_layers: 2},"
                                                  "auto")
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--budget"] == ["15GiB", "20GiB", "25GiB", "30GiB"]
    stem = f"res/profile_seed_DEVICE_torch{torch.__version__}".replace("+", "-")
    assert argv[argv.index("--json") + 1] == f"{stem}.json"
    assert argv[argv.index("--write-calibration") + 1] == f"{stem}_calibration.json"
    assert argv[argv.index("--distributed.strategy") + 1] == "single"
    assert argv[argv.index("--step_scheduler.global_batch_size") + 1] == "8"
    assert argv[-2:] == ["--logging.progress", "plain"]  # extra recipe overrides pass through


def test_without_cuda_it_refuses_clearly(script: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert script.main([]) == 2
    assert "no CUDA device here" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [(["--steps", "2", "--warmup", "2"], "must exceed --warmup"),
                                               (["--tolerance", "1.5"], "--tolerance: got 1.5")])
def test_bad_arguments_are_refused(script: ModuleType, argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_auto_is_judged_against_the_fastest_uniform_policy_that_fits(script: ModuleType) -> None:
    gib = 2**30

    def row(label: str, peak: float, step: float, **extra: object) -> dict[str, object]:
        return {"label": label, "policy_text": label, "peak_bytes": int(peak * gib), "peak_gib": peak,
                "median_step_s": step, "tokens_per_s": 16384 / step, "step_flops": 10**14, **extra}

    report = {"device": "GPU", "torch_version": "2.11", "steps": 8, "warmup_steps": 2, "loss_difference": 0.0,
              "settings": [row("none", 35, 0.33), row("selective", 18, 0.385), row("full", 12, 0.40), row("full, every 2nd block", 22, 0.367),
                           row("auto@20GiB", 19.5, 0.36, plan={"budget_bytes": 20 * gib, "budget_gib": 20.0}),
                           row("auto@15GiB", 14.9, 0.41, plan={"budget_bytes": 15 * gib, "budget_gib": 15.0})]}
    twenty, fifteen = script.verdicts(report, tolerance=0.02)
    assert twenty["fastest_fitting_uniform"] == "selective" and twenty["no_slower"]
    assert twenty["ratio"] == pytest.approx(0.36 / 0.385)
    assert fifteen["fastest_fitting_uniform"] == "full" and fifteen["ratio"] == pytest.approx(0.41 / 0.40)
    assert not fifteen["no_slower"]  # 2.5% slower: outside the 2% tolerance
    text = script.markdown(report, [twenty, fifteen], "remat profile ...", 0.02)
    assert "| 20 | 19.50 | 0.3600 | selective | 0.385 | 0.935 | yes |" in text and "| NO |" in text
