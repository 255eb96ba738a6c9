"""The document-attention benchmark runs end to end at small lengths and shows the dense mask's square growth
(keeps it from rotting)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path


SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_document_attention.py"


def test_benchmark_runs_and_the_document_wise_peak_is_linear(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_document_attention", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--lengths", "256,512", "--document-tokens", "32", "--rounds", "1",
                       "--out", str(tmp_path / "smoke")]) == 0
    rows = {(row["tokens_per_row"], row["attention"]): row for row in json.loads((tmp_path / "smoke.json").read_text())}
    peak = {key: row["peak_bytes"] for key, row in rows.items()}
    assert peak[(512, "document-wise")] <= 2 * peak[(256, "document-wise")]
    assert peak[(512, "dense mask")] > peak[(512, "document-wise")]
    assert rows[(512, "dense mask")]["largest_allocation_bytes"] >= 2 * 512 * 512  # the [rows, 1, T, T] mask
    assert "| 512 | document-wise |" in (tmp_path / "smoke.md").read_text()
