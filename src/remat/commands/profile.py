"""``remat profile RECIPE --policies none,selective,full,auto [--steps N] [--budget SIZE ...] [--json PATH]
[--png PATH] [--write-calibration PATH]``: real steps of each checkpointing setting, side by side."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

NAME = "profile"

DESCRIPTION = """\
Run the recipe for a few real steps under each checkpointing setting, one after another in this process, on the
recipe's device (a fresh model each, same seed and data), and print peak memory, median step time, tokens/s and
counted step FLOPs side by side, with ratios to `none`:
  remat profile examples/quickstart.yaml --policies none,selective,full --steps 4
  remat profile recipe.yaml --policies none,full,auto --budget 20GiB --budget 30GiB --png profile.png
  remat profile recipe.yaml --policies none,selective,full --write-calibration calibration.json
Settings are the spellings of distributed.activation_checkpointing (none, full, selective, attention, mlp, offload,
sqrt, true, false, or a mapping such as '{mode: full, every_n_layers: 2}') and auto, which is planned for each --budget (labelled auto@20GiB; without --budget, the
recipe's activation_checkpointing.memory_budget). The first step of each setting is a warm-up: its FLOPs are counted (torch's
FLOP counter) and it is left out of the medians and peaks, as are further --warmup steps. Peak memory is the
largest step peak (CUDA: max_memory_allocated reset before each step; CPU: the exact tracked peak of live tensors).
--rounds N runs the whole list N times in turn (medians over all rounds): on a shared machine, whose speed drifts,
each setting then meets the drift alike.
--write-calibration fits the rates the planner prices recompute at (extra step time over `none` against the extra
FLOPs counted and, when both come out positive, the extra bytes memory-bound ops wrote) and writes them for
`remat plan --calibration PATH` and activation_checkpointing.calibration.
One process: for a ddp / fsdp2 recipe, profile one rank's shape (--distributed.strategy single ...).
Recipe keys can be overridden like with `remat finetune` (--step_scheduler.local_batch_size 4). See docs/planner.md.
"""

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        NAME, help="measure peak memory and step time of checkpointing settings side by side (real steps)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", help="a YAML recipe (see examples/)")
    parser.add_argument("--policies", default="none,selective,full,auto", metavar="LIST",
                        help="comma-separated settings (default none,selective,full,auto)")
    parser.add_argument("--steps", type=int, default=5, metavar="N",
                        help="steps per setting, warm-up included (default 5)")
    parser.add_argument("--warmup", type=int, default=1, metavar="N",
                        help="first steps of each setting left out of the medians (default 1, at least 1)")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="run the whole list N times in turn, a fresh model each time, and take medians over "
                             "all rounds: the drift of a busy machine then falls on every setting alike (default 1)")
    parser.add_argument("--budget", action="append", default=[], metavar="SIZE",
                        help="memory budget for auto: bytes, a size such as 20GiB, or a fraction of the GPU's "
                             "memory; repeat it to profile auto at several budgets")
    parser.add_argument("--json", metavar="PATH", help="write every setting's steps and medians as JSON")
    parser.add_argument("--png", metavar="PATH", help="write a chart of peak memory against median step time")
    parser.add_argument("--write-calibration", metavar="PATH",
                        help="fit the planner's FLOP/s from these runs (needs none among --policies) and write it")
    parser.add_argument("--workdir", metavar="DIR",
                        help="where the settings' runs write (default: a temporary folder, removed afterwards)")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from remat.planner.profile import BASELINE, parse_settings
    from remat.recipes.loader import load_recipe_data

    settings = parse_settings(args.policies, args.budget)  # before torch loads: a typo is said at once
    from remat.recipes.run_safety.output_paths import check_output_file

    for flag, value in (("--json", args.json), ("--png", args.png), ("--write-calibration", args.write_calibration)):
        if value:
            check_output_file(Path(value), flag)
    if args.write_calibration and not any(s.label == BASELINE for s in settings):
        from remat.errors import ConfigError

        raise ConfigError(f"--write-calibration: needs {BASELINE} among --policies (the step without recompute "
                          "that the others' extra time is measured against)")
    if args.workdir is not None:  # said before anything loads: a path under a regular file, a read-only place
        from remat.recipes.run_safety.output_paths import check_writable_dir

        check_writable_dir(Path(args.workdir), "--workdir")
    data = load_recipe_data(args.recipe, overrides)
    compiled = data.get("compile")
    if args.write_calibration and isinstance(compiled, dict) and compiled.get("enabled") is True:
        from remat.errors import ConfigError

        raise ConfigError("--write-calibration: the recipe compiles its blocks (compile.enabled: true), whose steps "
                          "cannot be counted (NOTE [ A counted step is never compiled ]); allowed: the recipe with "
                          "--compile.enabled false, or no --write-calibration")

    from remat.planner.calibration import make_calibration, write_calibration
    from remat.planner.profile_run import profile_recipe

    report = profile_recipe(data, settings, recipe=args.recipe, steps=args.steps, warmup=args.warmup,
                            rounds=args.rounds, workdir=args.workdir)
    print(report.table())
    if args.json:
        from remat.commands._output import write_json

        write_json(args.json, report.to_dict())
    if args.png:
        logger.info("wrote %s", report.plot(args.png))
    if args.write_calibration:
        calibration = make_calibration(report.samples(), device=report.device, target=report.target,
                                       torch_version=report.torch_version)
        print(f"calibration: {calibration.describe()}")
        if "note" in calibration.details:
            print(f"  note: {calibration.details['note']}")
        logger.info("wrote %s", write_calibration(calibration, args.write_calibration))
    return 0 if all(r.ok for r in report.results) else 1
