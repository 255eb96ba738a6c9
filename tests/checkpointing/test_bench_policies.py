"""The policies benchmark runs end to end on a tiny model and writes consistent results (keeps it from rotting)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_policies.py"


@pytest.mark.slow
def test_benchmark_runs_and_orders_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("bench_policies", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    argv = ["--hidden", "32", "--intermediate", "128", "--layers", "4", "--heads", "4", "--vocab", "128", "--seq", "16",
            "--batch", "2", "--rounds", "1", "--out", str(tmp_path), "--name", "smoke", "--note", "smoke test"]
    assert bench.main(argv) == 0
    data = json.loads((tmp_path / "smoke.json").read_text())
    rows = {row["label"]: row for row in data["rows"]}
    assert list(rows) == [label for label, _ in bench.POLICIES]
    act = {label: row["activation_bytes_after_forward"] for label, row in rows.items()}
    flops = {label: row["flops"] for label, row in rows.items()}
    assert act["none"] > act["selective"] > act["full"] > act["sqrt"]
    assert act[bench.HF_ROW] == act["full"] and flops[bench.HF_ROW] == flops["full"]
    assert flops["full"] > flops["selective"] > flops["none"] == flops["offload"]
    assert all(len(row["step_seconds"]) == 1 for row in rows.values())
    markdown = (tmp_path / "smoke.md").read_text()
    assert "smoke test" in markdown and "| none | " in markdown and data["machine"]["torch"] in markdown
