"""A picture and a summary of a finished (or running) fine-tune, read back from its metrics file.

``remat report OUTPUT_DIR`` and the end of every training run call :func:`write_run_report`: it reads
``metrics.jsonl`` (one JSON object per optimizer step, ``kind: train``, and per validation, ``kind: validation``),
draws ``report.png`` (loss with validation, peak memory, tokens/s, each over steps) and returns a
:class:`RunSummary` whose ``lines()`` are printed. A resumed run appends to the same metrics file, each row marked
with its ``attempt``; when a step appears more than once (steps trained again after a crash), the latest attempt's row
is the one shown, and steps that an earlier attempt trained beyond where a later one resumed are left out.
"""

from __future__ import annotations

import io
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat._files import write_atomic
from remat.errors import ConfigError
from remat.recipes.run_safety.output_paths import REPORT_FILE

GIB = 1024**3


@dataclass(frozen=True)
class RunSummary:
    """What a run did, from its metrics: steps, time, tokens, losses, peak memory and where its model is."""

    first_step: int
    last_step: int
    train_time_s: float
    label_tokens: int
    final_loss: float
    best_loss: float
    best_loss_step: int
    final_val_loss: float | None
    best_val_loss: float | None
    best_val_step: int | None
    peak_mem_bytes: int
    mem_source: str
    median_tps: float
    model_dir: Path | None = None

    def lines(self) -> list[str]:
        """The summary as a few lines of text (printed at the end of training and by ``remat report``)."""
        out = [
            f"trained steps {self.first_step}-{self.last_step} in {_duration(self.train_time_s)} "
            f"({self.label_tokens:,} label tokens, median {self.median_tps:,.0f} tokens/s)",
            f"loss: final {self.final_loss:.4f}, best {self.best_loss:.4f} at step {self.best_loss_step}",
        ]
        if self.final_val_loss is not None:
            out.append(f"validation loss: final {self.final_val_loss:.4f}, best {self.best_val_loss:.4f} at step "
                       f"{self.best_val_step}")
        out.append(f"peak memory {self.peak_mem_bytes / GIB:.2f} GiB ({self.mem_source})")
        if self.model_dir is not None:
            out.append(f"model: {self.model_dir} (load it with transformers' from_pretrained)")
        return out


def _duration(seconds: float) -> str:
    minutes, secs = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours}h{minutes:02d}m{secs:02.0f}s" if hours else f"{minutes}m{secs:04.1f}s" if minutes else f"{secs:.1f}s"


#: What the report reads of each kind of row.
_ROW_KEYS: dict[str, tuple[str, ...]] = {"train": ("loss", "mem_bytes", "mem_source", "tps"),
                                         "validation": ("val_loss",)}


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The train and validation rows of a metrics file along the run's current line of history, one per step, in
    step order: the latest attempt's rows, then each earlier attempt's rows for the steps before the later ones
    began (`current_line`)."""
    if not path.is_file():
        raise ConfigError(f"{path}: no metrics file here; a run writes it when logging.metrics_file is set "
                          "(default metrics.jsonl in the output_dir)")
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                row["step"] = int(row["step"])
                row["kind"]  # noqa: B018 (a KeyError names the malformed row)
            except (ValueError, KeyError, TypeError, RecursionError):
                raise ConfigError(f"{path}:{number}: not a metrics row (a JSON object with 'kind' and 'step')") from None
            missing = [key for key in _ROW_KEYS.get(row["kind"], ()) if not isinstance(row.get(key), (int, float, str))]
            if missing:
                raise ConfigError(f"{path}:{number}: a {row['kind']} row without {', '.join(missing)}; allowed: rows "
                                  "as remat finetune writes them (a file from another tool or an edited one?)")
            rows.append(row)
    kept = current_line(rows)
    return ([r for r in kept if r["kind"] == "train"], [r for r in kept if r["kind"] == "validation"])


def current_line(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows (in file order) reduced to one per (kind, step), sorted by step, following the newest attempt.

    Rows are grouped into attempts by their ``attempt`` value in file order (files written before attempts were
    recorded: the last row of a step wins). The newest attempt's rows are kept; an earlier attempt contributes only
    the steps before the first train step of every later attempt, so a resumed run that went back (e.g. resumed from
    an older checkpoint) never draws the abandoned steps of the run it replaced and duplicate steps never zig-zag."""
    groups: list[list[dict[str, Any]]] = []
    for row in rows:
        if not groups or row.get("attempt") != groups[-1][-1].get("attempt"):
            groups.append([])
        groups[-1].append(row)
    kept: dict[tuple[str, int], dict[str, Any]] = {}
    floor = math.inf  # the first train step of every attempt newer than the group at hand
    for group in reversed(groups):
        own = {(row["kind"], row["step"]): row for row in group if row["step"] < floor}  # the group's last row wins
        for key, row in own.items():
            kept.setdefault(key, row)
        floor = min([floor, *(row["step"] for row in group if row["kind"] == "train")])
    return sorted(kept.values(), key=lambda r: (r["step"], r["kind"]))


def summarize_run(train: list[dict[str, Any]], val: list[dict[str, Any]], *,
                  model_dir: Path | None = None) -> RunSummary:
    """Summarise metrics rows as returned by :func:`read_metrics`."""
    if not train:
        raise ConfigError("the metrics file holds no training step yet")
    best = min(train, key=lambda r: r["loss"])
    best_val = min(val, key=lambda r: r["val_loss"]) if val else None
    peak = max(train, key=lambda r: r["mem_bytes"])
    return RunSummary(
        first_step=train[0]["step"], last_step=train[-1]["step"],
        train_time_s=sum(r["step_time_s"] for r in train),
        label_tokens=sum(r["num_label_tokens"] for r in train),
        final_loss=train[-1]["loss"], best_loss=best["loss"], best_loss_step=best["step"],
        final_val_loss=val[-1]["val_loss"] if val else None,
        best_val_loss=best_val["val_loss"] if best_val else None,
        best_val_step=best_val["step"] if best_val else None,
        peak_mem_bytes=peak["mem_bytes"], mem_source=peak["mem_source"],
        median_tps=statistics.median(r["tps"] for r in train),
        model_dir=model_dir,
    )


def plot_run(train: list[dict[str, Any]], val: list[dict[str, Any]], path: Path, *, title: str = "") -> Path:
    """Draw loss (train and validation), peak memory and tokens/s over steps into the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in train]
    fig, (loss_ax, mem_ax, tps_ax) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    loss_ax.plot(steps, [r["loss"] for r in train], label="train", color="tab:blue")
    if val:
        loss_ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation",
                     color="tab:orange")
    loss_ax.set_ylabel("loss")
    loss_ax.legend()
    mem = [r["mem_bytes"] / GIB for r in train]
    tps = [r["tps"] for r in train]
    mem_ax.plot(steps, mem, color="tab:green")
    mem_ax.set_ylabel(f"peak memory (GiB, {train[-1]['mem_source']})")
    mem_ax.set_ylim(0, max(mem) * 1.15 or 1.0)
    tps_ax.plot(steps, tps, color="tab:purple")
    tps_ax.set_ylabel("tokens/s")
    tps_ax.set_ylim(0, max(tps) * 1.15 or 1.0)
    tps_ax.set_xlabel("step")
    for ax in (loss_ax, mem_ax, tps_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(title or "remat run")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=100, format="png")
    plt.close(fig)
    write_atomic(path, buffer.getvalue(), "run report", durable=False)
    return path


def write_run_report(output_dir: Path, *, metrics_file: str = "metrics.jsonl",
                     model_dir: Path | None = None) -> tuple[RunSummary, Path]:
    """Read ``output_dir/metrics_file``, write ``output_dir/report.png`` and return the summary and the PNG's path."""
    train, val = read_metrics(output_dir / metrics_file)
    summary = summarize_run(train, val, model_dir=model_dir)
    png = plot_run(train, val, output_dir / REPORT_FILE, title=f"remat run: {output_dir}")
    return summary, png
