"""``remat plan RECIPE [--budget SIZE ...] [--json PATH] [--png PATH]``: the per-layer checkpointing plan with the
least predicted recompute that fits each memory budget."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

NAME = "plan"

DESCRIPTION = """\
Choose activation checkpointing per block (none / attention / mlp / selective / full) for the least predicted
recompute whose predicted step peak fits a memory budget, as `distributed.activation_checkpointing: auto` does.
Each mode is measured once per kind of block on fake tensors (bytes kept, FLOPs recomputed); every plan considered
is priced by the memory estimate (`remat estimate`), no GPU needed.
  remat plan examples/llama_3_2_1b_seed.yaml --budget 80GiB --budget 40GiB --budget 20GiB --budget 12GiB
  remat plan recipe.yaml --budget 0.8 --json plan.json --png plan.png     (0.8 of this GPU's memory)
A budget is bytes, a size (40GiB, 24GB) or a fraction of the GPU's memory; without --budget, the recipe's
activation_checkpointing.memory_budget, else the GPU's memory minus a margin. The budget is per rank. The printout gives the
frontier (uniform policies with their predicted peak and recompute), then per budget the plan: per block the mode,
bytes kept and saved and FLOPs recomputed, the predicted peak and the recompute overhead. See docs/planner.md.
Recompute seconds are FLOPs at a throughput: --flops-per-second, or one measured on this device by
`remat profile RECIPE --write-calibration cal.json` and given as --calibration cal.json (or the recipe's
activation_checkpointing.calibration).
Recipe keys can be overridden like with `remat finetune` (--step_scheduler.local_batch_size 4).
"""

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        NAME, help="plan per-layer activation checkpointing for a memory budget (no GPU needed)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", help="a YAML recipe (see examples/)")
    parser.add_argument("--budget", action="append", default=[], metavar="SIZE",
                        help="memory budget per rank: bytes, a size such as 40GiB, or a fraction of the GPU's "
                             "memory; repeat it to plan several budgets in one run")
    parser.add_argument("--target", choices=("cuda", "cpu"),
                        help="plan for a CUDA GPU or the CPU; default: what the recipe would train on here, as "
                             "remat finetune plans it (distributed.device cpu, or auto without a GPU: cpu). "
                             "--target cuda plans for a GPU this machine does not have")
    parser.add_argument("--world-size", type=int, help="data-parallel ranks (ddp / fsdp2 recipes without dp_size)")
    parser.add_argument("--flops-per-second", type=float,
                        help="throughput recompute is priced at (default: 4e14 for cuda, 5e10 for cpu)")
    parser.add_argument("--calibration", metavar="PATH",
                        help="price recompute at the throughput measured by `remat profile --write-calibration PATH` "
                             "(default: the recipe's activation_checkpointing.calibration, else the default above)")
    parser.add_argument("--loss-choice", choices=("keep", "choose"),
                        help="choose: plan for the plain and the fused loss and keep the faster plan that fits (its "
                             "note names the loss); keep: the recipe's loss (default: the recipe's "
                             "activation_checkpointing.loss, else keep)")
    parser.add_argument("--json", metavar="PATH", help="write the frontier and every budget's plan as JSON")
    parser.add_argument("--png", metavar="PATH", help="write a chart of predicted peak against recompute")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from remat.errors import ConfigError
    from remat.planner.api import (
        default_target,
        loss_chooser_for_recipe,
        planner_for_recipe,
        recipe_budget,
    )
    from remat.planner.report import BudgetAnswer, plot_plans, report_dict, report_text
    from remat.recipes.loader import load_recipe

    from remat.recipes.output_paths import check_output_file

    for flag, value in (("--json", args.json), ("--png", args.png)):
        if value:
            check_output_file(Path(value), flag)
    cfg = load_recipe(args.recipe, overrides)
    target = args.target or default_target(cfg.distributed.device)  # one rule with remat finetune and Python
    budgets = [recipe_budget(cfg, budget, target, key="--budget") for budget in (args.budget or [None])]
    options: dict[str, Any] = {"world_size": args.world_size} if args.world_size else {}
    options["flops_per_second"] = _flops_per_second(args, target)
    own_choice = cfg.distributed.auto.loss if cfg.distributed.auto is not None else "keep"
    if (args.loss_choice or own_choice) == "choose":
        chooser = loss_chooser_for_recipe(cfg, target=target, **options)
        planner = chooser.planner(chooser.own_loss)
    else:
        chooser = planner = planner_for_recipe(cfg, target=target, **options)
    frontier = planner.uniform_candidates(max(budgets))
    answers = []
    for budget in budgets:
        try:
            answers.append(BudgetAnswer(budget, chooser.plan(budget, all_candidates=True)))
        except ConfigError as err:
            answers.append(BudgetAnswer(budget, None, str(err)))
    print(report_text(planner, frontier, answers))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report_dict(planner, frontier, answers), indent=2) + "\n")
        logger.info("wrote %s", path)
    if args.png:
        step_flops = planner.measurements.step_flops * planner.settings.grad_accumulation
        logger.info("wrote %s", plot_plans(frontier, answers, args.png, step_flops=step_flops))
    return 0 if all(answer.plan is not None for answer in answers) else 1



def _flops_per_second(args: argparse.Namespace, target: str) -> float | None:
    """``--flops-per-second``, or the throughput in ``--calibration``; None leaves it to the recipe / default."""
    from remat.errors import ConfigError
    from remat.planner.calibration import calibrated_flops_per_second

    if args.calibration is None:
        return args.flops_per_second
    if args.flops_per_second is not None:
        raise ConfigError("--calibration: give it or --flops-per-second, not both (each sets the throughput "
                          "recompute is priced at)")
    return calibrated_flops_per_second(args.calibration, target, key="--calibration")
