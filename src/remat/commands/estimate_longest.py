"""``remat estimate --longest --fits SIZE [--compare] [--confirm]``: the longest sequence that fits, per setting.

The options live in `add_arguments` (the ``estimate`` command's parser calls it) and the run in `run_longest`;
the search itself is `remat.estimate.longest.find_longest`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LONGEST_EXTRA_ROWS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("full + tiled + fused", {"mode": "full", "tiled": True}),
    ("full + tiled + offload + fused", {"mode": "full", "tiled": True, "offload": True}),
)
"""The rows ``--longest --compare`` adds after none/selective/full x plain/fused (fused loss, the tile length the
policy defaults to: the model's hidden size)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--longest`` options of ``remat estimate``."""
    group = parser.add_argument_group("how long can I train? (--longest)")
    group.add_argument("--longest", action="store_true",
                       help="answer the longest sequence length (tokens per row, at the batch size) whose predicted "
                            "peak fits --fits, per setting; with --compare also full + tiled and full + tiled + "
                            "offload with the fused loss")
    group.add_argument("--confirm", action="store_true",
                       help="with --longest: check each answer with direct estimates at it and one granularity step "
                            "beyond (slow at long lengths)")
    group.add_argument("--granularity", type=int, metavar="TOKENS",
                       help="with --longest: round answers down to a multiple of this (default 1024, or the tile "
                            "length with tiling)")
    group.add_argument("--window-start", type=int, metavar="TOKENS",
                       help="with --longest: the first of the three sample lengths (default 32768, at least 16 tiles "
                            "with tiling; the others are 1.25x and 1.5x it)")
    group.add_argument("--jobs", type=int, metavar="N",
                       help="with --longest: worker processes for the estimates (default: the CPU count, at most 4)")


def check_arguments(args: argparse.Namespace) -> None:
    """Raise `ConfigError` for ``--longest`` options given without it, or ``--longest`` without what it needs."""
    from remat.errors import ConfigError

    if not args.longest:
        for flag, value in (("--confirm", args.confirm), ("--granularity", args.granularity), ("--jobs", args.jobs),
                            ("--window-start", args.window_start)):
            if value:
                raise ConfigError(f"{flag}: only with --longest")
        return
    if not args.fits:
        raise ConfigError("--longest: needs --fits SIZE, the device memory to fit (e.g. --fits 80GiB)")
    if args.seq_length is not None:
        raise ConfigError("--seq-length: --longest searches the sequence length; remove --seq-length")
    if args.plot:
        raise ConfigError("--plot: not available with --longest (it charts breakdowns at one length); remove --plot")
    for flag, value in (("--jobs", args.jobs), ("--granularity", args.granularity),
                        ("--window-start", args.window_start)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag}: got {value}; allowed: an integer >= 1")


def longest_rows(rows: list[tuple[str, Any]], compared: int) -> list[tuple[str, Any]]:
    """The ``--compare`` rows with the rows of `LONGEST_EXTRA_ROWS` inserted after the first ``compared`` (none /
    selective / full x plain / fused, the last of them full + fused), before the ``--setting`` rows."""
    fused = rows[compared - 1][1]
    tiled = [(label, dataclasses.replace(fused, policy=policy)) for label, policy in LONGEST_EXTRA_ROWS]
    return rows[:compared] + tiled + rows[compared:]


def run_longest(args: argparse.Namespace, model: Any, rows: list[tuple[str, Any]], capacity: int) -> int:
    """Answer every row, print the table and write ``--json``."""
    from remat.commands._output import write_json
    from remat.estimate.longest import find_longest
    from remat.estimate.longest_report import longest_table

    jobs = args.jobs or min(4, os.cpu_count() or 1)
    rows = [(label or settings.describe(), settings) for label, settings in rows]
    answers = find_longest(model, rows, capacity, confirm=args.confirm, granularity=args.granularity,
                           window_start=args.window_start, jobs=jobs)
    print(longest_table(answers, model=model.describe()))
    if args.json:
        write_json(Path(args.json), [a.to_dict() for a in answers] if args.compare else answers[0].to_dict())
    return 0
