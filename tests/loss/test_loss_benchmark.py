"""The loss benchmark script runs end to end on tiny shapes and writes consistent results."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_loss.py"


def test_benchmark_writes_markdown_and_json_with_ratios_against_the_plain_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("bench_loss", BENCH)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_loss", bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    out = tmp_path / "loss"
    rows = bench.main(["--vocab", "4096", "--tokens", "1024", "--seq", "512", "--hidden", "16", "--repeats", "2",
                       "--variants", "plain", "fused", "fused-recompute", "--note", "test run", "--out", str(out)])
    payload = json.loads(out.with_suffix(".json").read_text())
    assert [row["variant"] for row in payload["rows"]] == ["plain", "fused", "fused-recompute"]
    plain, fused, recompute = rows
    assert plain.working_ratio == 1.0 and len(plain.times_s) == 2
    assert fused.working_bytes < plain.working_bytes and recompute.working_bytes < plain.working_bytes
    assert abs(fused.loss - plain.loss) < 1e-4 and abs(recompute.loss - plain.loss) < 1e-4
    assert fused.inputs_bytes == plain.inputs_bytes == (1024 * 16 + 4096 * 16) * 4
    assert fused.flops == 3 * 2 * (2 * (512 - 128)) * 4096 * 16 and plain.flops == 3 * 2 * 1024 * 4096 * 16
    markdown = out.with_suffix(".md").read_text()
    assert "| 4096 | fused |" in markdown and "test run" in markdown
