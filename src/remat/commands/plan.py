"""``remat plan RECIPE [--budget SIZE ...] [--json PATH] [--png PATH]``: the per-layer checkpointing plan with the
least predicted recompute that fits each memory budget."""

from __future__ import annotations

import argparse
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
  remat plan meta-llama/Llama-3.2-1B --batch-size 8 --seq-length 2048 --autocast bfloat16 --target cuda --budget 20GiB
A Hub id or a local model directory is read for its config.json only (the HF cache offline, the Hub online; never
weights), and the step comes from the flags (defaults: batch 1 x 2048, the model's dtype, plain loss, AdamW).
A budget is bytes, a size (40GiB, 24GB) or a fraction of the GPU's memory; without --budget, the recipe's
activation_checkpointing.memory_budget, else the GPU's memory minus a margin. The budget is per rank. The printout gives the
frontier (uniform policies with their predicted peak and recompute), then per budget the plan: per block the mode,
bytes kept and saved and FLOPs recomputed, the predicted peak and the recompute overhead. See docs/planner.md.
Recompute seconds are FLOPs at a throughput (--flops-per-second), or the rates measured on this device by
`remat profile RECIPE --write-calibration cal.json` and given as --calibration cal.json (or the recipe's
activation_checkpointing.calibration): FLOPs and, when the fit separates them, the bytes memory-bound ops write, each
at its rate; plans are then chosen for the fewest predicted seconds (a `recompute s` column per candidate).
Recipe keys can be overridden like with `remat finetune` (--step_scheduler.local_batch_size 4).
"""

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        NAME, help="plan per-layer activation checkpointing for a memory budget (no GPU needed)",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", help="a YAML recipe (see examples/), or a model: a Hub id or a local model "
                                       "directory (its config.json only), with the step given by the flags below")
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
                        help="price recompute at the rates measured by `remat profile --write-calibration PATH` "
                             "(default: the recipe's activation_checkpointing.calibration, else the default above)")
    parser.add_argument("--loss-choice", choices=("keep", "choose"),
                        help="choose: plan for the plain and the fused loss and keep the faster plan that fits (its "
                             "note names the loss); keep: the recipe's loss (default: the recipe's "
                             "activation_checkpointing.loss, else keep)")
    step = parser.add_argument_group("the step of a Hub id or model directory (a recipe has its own)")
    step.add_argument("--batch-size", type=int, help="micro-batch per rank (default 1)")
    step.add_argument("--seq-length", type=int, help="tokens per row (default 2048)")
    step.add_argument("--dtype", help="parameter dtype (default: the model's)")
    step.add_argument("--autocast", help="autocast dtype (bfloat16, float16), or none")
    step.add_argument("--loss", help="plain (cross-entropy on logits, the default) or fused")
    step.add_argument("--optimizer", help="optimizer class (default torch.optim.AdamW)")
    step.add_argument("--strategy", help="single (default), ddp or fsdp2 (with --world-size)")
    step.add_argument("--grad-accumulation", type=int, help="micro-batches per optimizer step")
    parser.add_argument("--json", metavar="PATH", help="write the frontier and every budget's plan as JSON")
    parser.add_argument("--png", metavar="PATH", help="write a chart of predicted peak against recompute")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from remat.commands._model_source import model_source
    from remat.errors import ConfigError
    from remat.planner.report import BudgetAnswer, plot_plans, report_dict, report_text
    from remat.recipes.run_safety.output_paths import check_output_file

    for flag, value in (("--json", args.json), ("--png", args.png)):
        if value:
            check_output_file(Path(value), flag)
    source = model_source(args.recipe)
    step_flags = {name: getattr(args, name) for name in _STEP_FLAGS if getattr(args, name) is not None}
    if source is None:
        if step_flags:
            flag = "--" + next(iter(step_flags)).replace("_", "-")
            raise ConfigError(f"{flag}: sets the step of a Hub id or model directory; a recipe has its own (override "
                              "its keys instead, e.g. --step_scheduler.local_batch_size 4)")
        chooser, planner, budgets = _recipe_planner(args, overrides)
    else:
        if overrides:
            raise ConfigError(f"unrecognized arguments: {' '.join(overrides)} (dotted recipe overrides need a recipe; "
                              "a model takes the step flags)")
        chooser, planner, budgets = _model_planner(args, source, step_flags)
    answers = []
    for budget in budgets:
        try:
            answers.append(BudgetAnswer(budget, chooser.plan(budget, all_candidates=True)))
        except ConfigError as err:
            answers.append(BudgetAnswer(budget, None, str(err)))
    # Each plan priced every uniform policy for its budget, so the frontier costs nothing more then; when no budget
    # reaches the smallest plan's peak (said after the one to three estimates of the floor), it is not priced at all.
    fits = any(answer.plan is not None for answer in answers)
    frontier = planner.uniform_candidates(max(budgets)) if fits else []
    print(report_text(planner, frontier, answers))
    if args.json:
        from remat.commands._output import write_json

        write_json(args.json, report_dict(planner, frontier, answers))
    if args.png:
        logger.info("wrote %s", plot_plans(frontier, answers, args.png, step_flops=planner.step_flops))
    return 0 if all(answer.plan is not None for answer in answers) else 1



_STEP_FLAGS: tuple[str, ...] = ("batch_size", "seq_length", "dtype", "autocast", "loss", "optimizer", "strategy",
                                "grad_accumulation")


def _recipe_planner(args: argparse.Namespace, overrides: list[str]) -> tuple[Any, Any, list[int]]:
    """The planner (and loss chooser) of a recipe's step, and the budgets in bytes."""
    from remat.planner.api import default_target, loss_chooser_for_recipe, planner_for_recipe, recipe_budget
    from remat.recipes.loader import load_recipe

    cfg = load_recipe(args.recipe, overrides, data_needed=False)
    target = args.target or default_target(cfg.distributed.device)  # one rule with remat finetune and Python
    budgets = [recipe_budget(cfg, budget, target, key="--budget") for budget in (args.budget or [None])]
    options: dict[str, Any] = {"world_size": args.world_size} if args.world_size else {}
    options.update(_pricing(args, target))
    own_choice = cfg.distributed.auto.loss if cfg.distributed.auto is not None else "keep"
    if (args.loss_choice or own_choice) == "choose":
        chooser = loss_chooser_for_recipe(cfg, target=target, **options)
        return chooser, chooser.planner(chooser.own_loss), budgets
    planner = planner_for_recipe(cfg, target=target, **options)
    return planner, planner, budgets


def _model_planner(args: argparse.Namespace, source: str, step_flags: dict[str, Any]) -> tuple[Any, Any, list[int]]:
    """The planner (and loss chooser) of a Hub model's or a model directory's step (its config.json only), with the
    step from the flags, and the budgets in bytes."""
    import dataclasses

    from remat.checkpointing.budget import parse_budget
    from remat.estimate.api import resolve_model
    from remat.estimate.settings import StepSettings
    from remat.models import ModelConfig
    from remat.planner.api import default_target, device_bytes
    from remat.planner.loss_choice import LossChooser
    from remat.planner.planner import Planner

    if step_flags.get("autocast") == "none":
        step_flags["autocast"] = None
    model = resolve_model(ModelConfig(pretrained_model_name_or_path=source))
    target = args.target or default_target("auto")
    settings = StepSettings(target=target, world_size=args.world_size or 1, **step_flags)  # type: ignore[arg-type]
    settings.validate()
    budgets = [parse_budget(budget, device_bytes=device_bytes(target), key="--budget")
               for budget in (args.budget or [None])]
    pricing = _pricing(args, target)
    if args.loss_choice == "choose":
        run = settings.run()
        chooser = LossChooser(dataclasses.replace(settings, policy="none").to_recipe(model),
                              lambda recipe: Planner(recipe, run, **pricing))
        return chooser, chooser.planner(chooser.own_loss), budgets
    planner = Planner.from_settings(model, settings, **pricing)
    return planner, planner, budgets


def _pricing(args: argparse.Namespace, target: str) -> dict[str, float | None]:
    """``--flops-per-second``, or the rates in ``--calibration`` (`remat.planner.timing`); None leaves them to the
    recipe / default."""
    from remat.errors import ConfigError
    from remat.planner.calibration import calibrated_rates

    if args.calibration is None:
        return {"flops_per_second": args.flops_per_second}
    if args.flops_per_second is not None:
        raise ConfigError("--calibration: give it or --flops-per-second, not both (each sets the throughput "
                          "recompute is priced at)")
    flops, memory = calibrated_rates(args.calibration, target, key="--calibration")
    return {"flops_per_second": flops, "memory_bytes_per_second": memory}
