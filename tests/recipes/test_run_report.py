"""The run report: summary numbers from the metrics file (resumed steps counted once) and the PNG it draws."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from remat.errors import ConfigError
from remat.recipes.reports.run_report import read_metrics, summarize_run, write_run_report

GIB = 1024**3


def _train(step: int, loss: float, mem: int, tps: float = 100.0) -> dict[str, Any]:
    return {"kind": "train", "step": step, "epoch": 0, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "mem_bytes": mem,
            "mem_source": "tracked", "tps": tps, "num_label_tokens": 10, "step_time_s": 0.5}


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_summary_counts_each_step_once_and_finds_the_best(tmp_path: Path) -> None:
    rows = [_train(1, 5.0, GIB), _train(2, 4.0, 2 * GIB), _train(3, 9.9, GIB),  # step 3 is trained again below
            {"kind": "validation", "step": 2, "val_loss": 4.5, "num_label_tokens": 7},
            _train(3, 3.0, GIB, tps=300.0), _train(4, 3.5, GIB),
            {"kind": "validation", "step": 4, "val_loss": 4.1, "num_label_tokens": 7}]
    train, val = read_metrics(_write(tmp_path / "metrics.jsonl", rows))
    summary = summarize_run(train, val, model_dir=tmp_path / "model")
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert (summary.first_step, summary.last_step, summary.label_tokens) == (1, 4, 40)
    assert summary.train_time_s == pytest.approx(2.0)
    assert (summary.final_loss, summary.best_loss, summary.best_loss_step) == (3.5, 3.0, 3)
    assert (summary.final_val_loss, summary.best_val_loss, summary.best_val_step) == (4.1, 4.1, 4)
    assert summary.peak_mem_bytes == 2 * GIB and summary.median_tps == 100.0
    text = "\n".join(summary.lines())
    assert "trained steps 1-4 in 2.0s (40 label tokens" in text
    assert "best 3.0000 at step 3" in text and "peak memory 2.00 GiB (tracked)" in text
    assert f"model: {tmp_path / 'model'}" in text


def test_report_png_is_drawn(tmp_path: Path) -> None:
    _write(tmp_path / "metrics.jsonl", [_train(s, 5.0 - s / 10, GIB) for s in range(1, 11)])
    _, png = write_run_report(tmp_path)
    assert png == tmp_path / "report.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000  # three panels with lines, not an empty canvas


@pytest.mark.parametrize(("content", "message"), [
    (None, "no metrics file here"),
    ("not json\n", "metrics.jsonl:1: not a metrics row"),
    ("", "holds no training step yet"),
])
def test_bad_metrics_are_one_line(tmp_path: Path, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(ConfigError, match=message):
        write_run_report(tmp_path)


def test_cli_report(tmp_path: Path) -> None:
    _write(tmp_path / "metrics.jsonl", [_train(s, 5.0 - s / 10, GIB) for s in range(1, 4)])
    proc = subprocess.run([sys.executable, "-m", "remat.cli", "report", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "trained steps 1-3" in proc.stdout and f"report: {tmp_path / 'report.png'}" in proc.stdout
    missing = subprocess.run([sys.executable, "-m", "remat.cli", "report", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "is not a directory" in missing.stderr and "Traceback" not in missing.stderr
