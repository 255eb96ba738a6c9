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


def _load(name: str, monkeypatch: pytest.MonkeyPatch):
    path = BENCH.with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_cuda_benchmark_refuses_without_cuda_and_says_how_to_check_it(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = _load("bench_loss_cuda", monkeypatch)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=r"measures on a CUDA device.*--check-on-cpu"):
        bench.main(["--out", "/nonexistent/never-written"])


def test_cuda_benchmark_runs_its_code_on_the_cpu_at_a_tiny_size(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from remat.loss import chunked
    from remat.loss.compiled import CompiledChunkMath

    monkeypatch.setattr(chunked, "CHUNK_MATH", CompiledChunkMath(compiler=lambda fn: fn))  # no C++ build here
    bench = _load("bench_loss_cuda", monkeypatch)
    out = tmp_path / "loss_cuda"
    rows = bench.main(["--check-on-cpu", "--variants", "plain", "remat-compiled", "remat-eager", "cce", "liger",
                       "--out", str(out)])
    payload = json.loads(out.with_suffix(".json").read_text())
    assert payload["config"]["check_on_cpu"] and payload["environment"]["device"].startswith("CPU")
    assert [(r["tokens"], r["variant"]) for r in payload["rows"]] == [
        (t, v) for t in (256, 512) for v in ("plain", "remat-compiled", "remat-eager", "cce", "liger")]
    by_key = {(row.tokens, row.variant): row for row in rows}
    for tokens in (256, 512):
        plain, fast, eager = (by_key[(tokens, v)] for v in ("plain", "remat-compiled", "remat-eager"))
        assert by_key[(tokens, "cce")].status.startswith("skipped") and by_key[(tokens, "cce")].median_ms is None
        assert len(fast.times_ms) == 2 and fast.time_vs_plain == fast.median_ms / plain.median_ms
        assert abs(fast.loss - plain.loss) < 1e-4 and abs(eager.loss - plain.loss) < 1e-4
        assert 0 < eager.working_bytes < plain.working_bytes and fast.working_bytes > 0
    markdown = out.with_suffix(".md").read_text()
    assert "| 512 | remat-compiled | ok |" in markdown and "no cce or plain row" not in markdown
