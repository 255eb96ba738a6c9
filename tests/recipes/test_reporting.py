from __future__ import annotations

import io
import json
from pathlib import Path

from remat.recipes.config import LoggingConfig
from remat.recipes.reports.reporting import RunReporter, StepRecord

RECORD = StepRecord(step=12, epoch=0, loss=3.21044, grad_norm=1.8249, lr=2e-4, mem_bytes=int(0.41 * 1024**3),
                    mem_source="tracked", tps=5120.4, num_label_tokens=2048, step_time_s=0.5)


def test_step_line_has_the_seed_form() -> None:
    assert RECORD.line() == ("step 12 | epoch 0 | loss 3.2104 | grad_norm 1.82 | lr 2.0e-04 | mem 0.41 GiB | "
                             "tps 5120 | num_label_tokens 2048")


def test_plain_reporter_prints_lines_and_writes_metrics(tmp_path: Path) -> None:
    out = io.StringIO()
    with RunReporter(LoggingConfig(progress="plain", log_every_steps=2), tmp_path, total_steps=20, stream=out) as rep:
        rep.step(RECORD)
        rep.step(StepRecord(**{**RECORD.__dict__, "step": 13}))
        rep.validation(12, 2.5, 100)
    lines = out.getvalue().splitlines()
    assert lines == [RECORD.line(), "step 12 | val_loss 2.5000 | val_label_tokens 100"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["train", "train", "validation"]
    assert rows[0]["loss"] == RECORD.loss and rows[0]["mem_source"] == "tracked"


def test_disabled_reporter_writes_nothing(tmp_path: Path) -> None:
    out = io.StringIO()
    with RunReporter(LoggingConfig(progress="plain"), tmp_path / "x", total_steps=5, enabled=False, stream=out) as rep:
        rep.step(RECORD)
        rep.info("hello")
    assert out.getvalue() == "" and not (tmp_path / "x").exists()
