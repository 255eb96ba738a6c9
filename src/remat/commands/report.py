"""``remat report OUTPUT_DIR``: the summary of a run and its ``report.png`` (loss, memory, tokens/s over steps)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

NAME = "report"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        NAME, help="summarise a run and draw its report.png (loss, memory, tokens/s over steps)",
        description="Read OUTPUT_DIR/metrics.jsonl, print the run's summary and write OUTPUT_DIR/report.png.",
    )
    parser.add_argument("output_dir", help="the run's output_dir (where its metrics.jsonl is)")
    parser.add_argument("--metrics-file", default="metrics.jsonl",
                        help="the metrics file's name inside OUTPUT_DIR (logging.metrics_file; default metrics.jsonl)")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from remat.errors import ConfigError

    if extra:
        raise ConfigError(f"report: unexpected arguments {' '.join(extra)}; usage: remat report OUTPUT_DIR")
    output_dir = Path(args.output_dir)
    if not output_dir.is_dir():  # said before torch and matplotlib load
        raise ConfigError(f"report: {str(output_dir)!r} is not a directory; give a run's output_dir")
    png_path = output_dir / "report.png"
    if png_path.is_symlink() or (png_path.exists() and not png_path.is_file()):
        from remat._files import kind_of

        what = "a symbolic link" if png_path.is_symlink() else kind_of(png_path.stat().st_mode)
        raise ConfigError(f"report: {str(png_path)!r} is {what}; remat writes a regular file there: move it away")
    from remat.recipes.reports.run_report import write_run_report
    from remat.training_state import find_latest_checkpoint
    latest = find_latest_checkpoint(output_dir / "checkpoints")
    model_dir = latest / "model" if latest is not None and (latest / "model").is_dir() else None
    summary, png = write_run_report(output_dir, metrics_file=args.metrics_file, model_dir=model_dir)
    print("\n".join([*summary.lines(), f"report: {png}"]))
    return 0
