"""benchmarks/bench_gpu.py measures on a GPU; its --check-on-cpu mode runs the same code on the CPU, which keeps the
script working where no GPU is lent. Here: every row and loss runs, the peaks order as checkpointing says, and the
results name the device and the torch version."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"


def _bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on it
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_check_on_cpu_runs_every_row_with_both_losses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench(monkeypatch)
    assert bench.main(["--check-on-cpu", "--batch", "4", "--seq", "256", "--warmup", "0", "--steps", "1",
                       "--profile", "selective,torch-sac", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("gpu_policies_*.json")
    (profile,) = tmp_path.glob("gpu_profile_*.md")  # one more step of the two rows named, under torch.profiler
    sections = profile.read_text().split("\n## ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["selective", bench.TORCH_SAC_ROW]
    assert all("Self CPU" in s for s in sections)
    data = json.loads(json_path.read_text())
    assert data["meta"]["torch"] == torch.__version__ and data["meta"]["device"].startswith("CPU")
    rows = {(row["label"], row["loss"]): row for row in data["rows"]}
    assert list(rows) == [(label, loss) for label, _ in bench.ROWS for loss in bench.LOSSES]
    assert all(row["error"] is None and len(row["step_seconds"]) == 1 for row in rows.values()), rows
    peak = {key: row["peak_bytes"] for key, row in rows.items()}
    for loss in bench.LOSSES:
        assert peak[("none", loss)] > peak[("selective", loss)] > peak[("full", loss)]
        assert peak[(bench.POLICIES[-1][0], loss)] == peak[("full", loss)]  # transformers' own = remat full
        assert peak[("none", loss)] > peak[(bench.TORCH_SAC_ROW, loss)] > peak[("full", loss)]
    assert peak[("none", "plain")] > peak[("none", "fused")]
    markdown = json_path.with_suffix(".md").read_text()
    assert data["meta"]["device"] in markdown and torch.__version__ in markdown and "| none | fused |" in markdown


def test_a_row_to_profile_that_does_not_exist_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _bench(monkeypatch).main(["--check-on-cpu", "--profile", "selectiv"])
    assert "--profile: selectiv is not a row; allowed: none, full, selective" in capsys.readouterr().err


def test_chosen_rows_with_a_forced_loss_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--rows and --losses: only the rows named, with the fused loss's backend forced (the step's time with each
    backend, side by side); a name that is neither is one line naming what is allowed."""
    bench = _bench(monkeypatch)
    assert bench.main(["--check-on-cpu", "--batch", "2", "--seq", "32", "--warmup", "0", "--steps", "1",
                       "--rows", "none;torch-sac", "--losses", "plain,fused:torch", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("gpu_policies_*.json")
    rows = [(row["label"], row["loss"]) for row in json.loads(json_path.read_text())["rows"]]
    assert rows == [(label, loss) for label in ("none", bench.TORCH_SAC_ROW) for loss in ("plain", "fused:torch")]
    for argv, message in ((["--rows", "nope"], "--rows: nope is not a row; allowed: none; full;"),
                          (["--losses", "fused:triton"], "--losses: got 'fused:triton'; allowed: comma-separated")):
        with pytest.raises(SystemExit):
            bench.main(["--check-on-cpu", *argv])
        assert message in capsys.readouterr().err


def test_refuses_to_run_without_a_gpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_long_context_check_on_cpu_measures_each_length(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench(monkeypatch)
    assert bench.main(["--check-on-cpu", "--long-context", "--lengths", "64,128", "--out", str(tmp_path)]) == 0
    (json_path,) = tmp_path.glob("gpu_long_context_*.json")
    data = json.loads(json_path.read_text())
    assert data["meta"]["torch"] == torch.__version__ and data["meta"]["lengths"] == [64, 128]
    rows = [(row["tokens_per_step"], row["label"]) for row in data["rows"]]
    assert rows == [(n, label) for n in (64, 128) for label, _ in bench.LONG_ROWS]
    assert all(row["error"] is None and len(row["step_seconds"]) == 1 and row["peak_bytes"] > 0
               for row in data["rows"]), data["rows"]
    markdown = json_path.with_suffix(".md").read_text()
    assert data["meta"]["device"] in markdown and torch.__version__ in markdown and "| 128 | full + tiled |" in markdown


def test_long_context_skips_a_length_that_would_overrun_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _bench(monkeypatch)
    args = bench.parse_args(["--check-on-cpu", "--long-context", "--lengths", "128,4096", "--budget-seconds", "0.5"])

    def slow(label: str, what: Any, loss: str, row: Any, device: Any) -> Any:
        return bench.Result(label=label, loss=loss, tokens_per_step=row.seq, peak_bytes=1, step_seconds=[0.2])

    monkeypatch.setattr(bench, "measure", slow)
    results = bench.run_long_context(args, torch.device("cpu"))
    assert [r.error is None for r in results] == [True, True, False, False]
    assert results[2].error.startswith("skipped:") and "4,096 tokens would take about 205 s" in results[2].error
