"""What a run tells its user: the per-step log line, a progress bar on terminals, a metrics file, and optionally
TensorBoard and Weights & Biases (`remat.recipes.reports.metric_sinks`).

The step line follows the seed documents' form, e.g.
``step 12 | epoch 0 | loss 3.2104 | grad_norm 1.82 | lr 2.0e-04 | mem 0.41 GiB | tps 5120 | num_label_tokens 2048``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from remat._files import open_append
from remat.recipes.config import LoggingConfig
from remat.recipes.reports.metric_sinks import MetricSink, open_sinks

GIB = 1024**3


@dataclass(frozen=True)
class StepRecord:
    """The metrics of one optimizer step (``step`` counts from 1)."""

    step: int
    epoch: int
    loss: float
    grad_norm: float
    lr: float
    mem_bytes: int
    mem_source: str
    tps: float
    num_label_tokens: int
    step_time_s: float
    skipped: bool = False  # the loss or gradient norm was NaN/inf and the update was not applied

    def line(self) -> str:
        return (
            f"step {self.step} | epoch {self.epoch} | loss {self.loss:.4f} | grad_norm {self.grad_norm:.2f} | "
            f"lr {self.lr:.1e} | mem {self.mem_bytes / GIB:.2f} GiB | tps {self.tps:.0f} | "
            f"num_label_tokens {self.num_label_tokens}" + (" | skipped (not finite)" if self.skipped else "")
        )


class RunReporter:
    """Prints step lines (plain, or above a rich progress bar on a terminal) and appends metrics as JSON lines.

    Every metrics row carries ``attempt``, the run's attempt number in its output_dir (see
    `remat.recipes.run_safety.run_lock`), so the rows of a resumed run that repeat steps of an earlier attempt can be told apart;
    TensorBoard hides the events of steps after ``start_step`` that an earlier attempt logged. Only the main process
    reports; on the others every method is a no-op.
    """

    def __init__(self, cfg: LoggingConfig, output_dir: Path, *, total_steps: int, start_step: int = 0,
                 enabled: bool = True, stream: TextIO | None = None, recipe: dict[str, Any] | None = None,
                 attempt: int = 1) -> None:
        self.cfg = cfg
        self.attempt = attempt
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self._progress: Progress | None = None
        self._task: Any = None
        self._metrics: TextIO | None = None
        self._sinks: list[MetricSink] = []
        if not enabled:
            return
        use_rich = cfg.progress == "rich" or (cfg.progress == "auto" and self.stream.isatty())
        if use_rich:
            console = Console(file=self.stream)
            self._progress = Progress(
                TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"), console=console, transient=False,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, status="")
            self._progress.start()
        if cfg.metrics_file:
            (output_dir / cfg.metrics_file).parent.mkdir(parents=True, exist_ok=True)
            self._metrics = open_append(output_dir / cfg.metrics_file, "logging.metrics_file")
        self._sinks = open_sinks(cfg, output_dir, recipe, start_step=start_step)

    def info(self, message: str) -> None:
        """A line of text for the user (above the progress bar when there is one)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(message, markup=False, highlight=False)
        else:
            print(message, file=self.stream, flush=True)

    def step(self, record: StepRecord) -> None:
        if not self.enabled:
            return
        if record.step % self.cfg.log_every_steps == 0:
            self.info(record.line())
        if self._progress is not None:
            self._progress.update(self._task, completed=record.step, status=f"loss {record.loss:.4f}")
        self._write({"kind": "train", "attempt": self.attempt, **asdict(record)})
        values = {f"train/{name}": float(getattr(record, name)) for name in ("loss", "grad_norm", "lr", "tps")}
        for sink in self._sinks:
            sink.scalars(record.step, {**values, "train/mem_gib": record.mem_bytes / GIB})

    def validation(self, step: int, loss: float, num_label_tokens: int) -> None:
        if not self.enabled:
            return
        self.info(f"step {step} | val_loss {loss:.4f} | val_label_tokens {num_label_tokens}")
        self._write({"kind": "validation", "attempt": self.attempt, "step": step, "val_loss": loss,
                     "num_label_tokens": num_label_tokens})
        for sink in self._sinks:
            sink.scalars(step, {"validation/loss": loss})

    def _write(self, row: dict[str, Any]) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps(row) + "\n")
            self._metrics.flush()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def __enter__(self) -> RunReporter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
