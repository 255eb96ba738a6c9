"""benchmarks/bench_pareto.py (the GPU acceptance's `pareto` part) measures on a GPU; its --check-on-cpu mode runs the
same code on the CPU. Here: the rows before auto are fitted into rates, auto plans with them and is predicted, every
budget gets a verdict, and a peer that fails is a row with its error, not the end of the run."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

@pytest.mark.slow
def test_check_on_cpu_fits_rates_plans_auto_and_records_a_failing_peer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, benchmark_script: Callable[[str], ModuleType]) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on it
    bench = benchmark_script("bench_pareto")

    def broken_peer(step: Any) -> Any:
        raise RuntimeError("this peer cannot run here")

    real_specs = bench.specs

    def specs(args: Any, wanted: Any) -> list[Any]:
        return [*real_specs(args, wanted), bench.Spec("a broken peer", "peer", apply=broken_peer)]

    monkeypatch.setattr(bench, "specs", specs)
    assert bench.main(["--check-on-cpu", "--rows", "none;full;auto;transformers checkpointing + Liger;a broken peer",
                       "--batch", "4", "--seq", "256", "--warmup", "1", "--steps", "1", "--out", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("pareto_*.json")).read_text())
    assert data["meta"]["torch"] == torch.__version__ and data["meta"]["device"].startswith("CPU")
    rows = {row["label"]: row for row in data["rows"]}
    assert rows["a broken peer"]["error"] == "RuntimeError: this peer cannot run here"
    assert rows["none"]["peak_bytes"] > rows["full"]["peak_bytes"]
    assert rows["none"]["flops"] < rows["full"]["flops"]  # counted for the fit: full recomputes
    assert data["calibration"]["target"] == "cpu" and data["calibration"]["flops_per_second"] > 0
    auto = [row for row in data["rows"] if row["budget_bytes"] is not None]
    assert len(auto) == 2 and all(row["error"] is None for row in auto)
    for row in auto:  # the tracker's peak is what the CPU estimate predicts, to the byte
        assert row["peak_bytes"] == row["predicted_peak_bytes"] <= row["budget_bytes"]
        assert row["predicted_seconds"] >= rows["none"]["median_seconds"]
    markdown = next(tmp_path.glob("pareto_*.md")).read_text()
    assert "## At each budget" in markdown and markdown.count("| auto @ ") >= 2
    assert next(tmp_path.glob("pareto_*.png")).stat().st_size > 0


@pytest.mark.slow
def test_auto_rows_with_compiled_blocks_are_planned_on_simulated_compiled_blocks(
        monkeypatch: pytest.MonkeyPatch, benchmark_script: Callable[[str], ModuleType]) -> None:
    """The `auto, compiled blocks @ ...` rows (run on a GPU only: on the CPU the tracker's dispatch mode would run
    the compiled blocks eagerly) are planned for compiled blocks and carry the compiled step into their rows."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    bench = benchmark_script("bench_pareto")
    from remat.recipes.config import CompileConfig

    args = bench.parse_args(["--check-on-cpu", "--batch", "2", "--seq", "64", "--budgets", "1GiB"])
    compiled = CompileConfig(enabled=True)
    specs, plans = bench.auto_specs(args, torch.device("cpu"), None, args.budgets, compiled)
    assert [spec.label for spec in specs] == ["auto, compiled blocks @ 1.00 GiB"] and specs[0].compile == compiled
    assert any(note.startswith("compile: the blocks are simulated compiled") for note in plans[specs[0].label].notes)
