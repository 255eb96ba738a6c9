"""``remat estimate [RECIPE] [--preset NAME | --config PATH] [options]``: predict the peak memory of a training step."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

NAME = "estimate"

DESCRIPTION = """\
Predict the peak device memory of one training step without a GPU: the step is simulated on fake tensors (seconds,
nothing allocated) and replayed through a model of PyTorch's CUDA caching allocator, so the peak is what
torch.cuda.max_memory_allocated() would report on any step after the first. The model comes from a recipe, a
preset or a config.json; options override the recipe's settings.
  remat estimate examples/llama_3_2_1b_seed.yaml
  remat estimate examples/llama_3_2_1b_seed.yaml --compare --fits 80GiB --plot estimate.png
  remat estimate --preset llama-3.2-1b --batch-size 8 --seq-length 2048 --autocast bfloat16 --policy full --loss fused
  remat estimate --config path/to/config.json --compare --setting policy=sqrt --setting batch_size=16,loss=fused
--compare prints one row per setting side by side: none, selective and full checkpointing, each with the plain and
the fused loss, then one row per --setting. A --setting is KEY=VALUE[,KEY=VALUE...] over the option names below
(batch_size, seq_length, dtype, autocast, policy, loss, optimizer, strategy, world_size, cp_size, tp_size,
mixed_precision, grad_accumulation, documents_per_row, target); values are read as YAML. Without --compare, one
--setting may adjust the single estimate. Recipe keys can be overridden like with `remat finetune` (--step_scheduler.local_batch_size 4).
--longest answers instead the longest sequence whose predicted peak fits --fits, per setting (with --compare
also full + tiled and full + tiled + offload, fused loss), from three estimates at shorter lengths extrapolated
per phase (--confirm checks each answer with direct estimates):
  remat estimate --preset llama-3.2-1b --batch-size 1 --dtype bfloat16 --longest --fits 80GiB --compare --json out.json
See docs/estimate.md for what is modelled and how the estimates compare with measurements, docs/long-context.md for
--longest.
"""

COMPARE_POLICIES: tuple[str, ...] = ("none", "selective", "full")
COMPARE_LOSSES: tuple[str, ...] = ("plain", "fused")

logger = logging.getLogger(__name__)

# (flag, setting name) for the options that override a setting.
_FLAGS: tuple[tuple[str, str], ...] = (
    ("batch_size", "batch_size"), ("seq_length", "seq_length"), ("dtype", "dtype"), ("autocast", "autocast"),
    ("policy", "policy"), ("loss", "loss"), ("optimizer", "optimizer"), ("strategy", "strategy"),
    ("world_size", "world_size"), ("cp_size", "cp_size"), ("tp_size", "tp_size"),
    ("mixed_precision", "mixed_precision"), ("grad_accumulation", "grad_accumulation"),
    ("documents_per_row", "documents_per_row"), ("target", "target"),
)


def register(subparsers: Any) -> None:
    from remat.commands.estimate_longest import add_arguments as add_longest_arguments
    from remat.models.presets import preset_names

    parser = subparsers.add_parser(
        NAME, help="predict the peak memory of a training step (no GPU needed)", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", nargs="?", help="a YAML recipe (see examples/), or a model: a Hub id such as "
                        "meta-llama/Llama-3.1-8B or a local model directory, of which only config.json is read (the HF "
                        "cache offline, the Hub online; never weights); or give --preset / --config")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", help=f"a model shape preset instead of a recipe: {', '.join(preset_names())}")
    source.add_argument("--config", help="a transformers config.json (or the directory holding it) instead of a recipe")
    _add_step_arguments(parser.add_argument_group("the step (defaults: the recipe's, else batch 1 x 2048, the "
                                                  "model's dtype, no checkpointing, plain loss, AdamW, one process, "
                                                  "CUDA)"))
    out = parser.add_argument_group("output")
    out.add_argument("--compare", action="store_true",
                     help="one row per setting: none/selective/full x plain/fused, plus each --setting")
    out.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE[,...]",
                     help="an extra --compare row, or (once, without --compare) an adjustment of the estimate")
    out.add_argument("--fits", metavar="SIZE",
                     help="device memory to check against, e.g. 80GiB, 80G (= GiB) or 24GB (10^9 bytes)")
    out.add_argument("--json", metavar="PATH", help="write the estimates as JSON")
    out.add_argument("--plot", metavar="PATH", help="write a PNG chart of the breakdown per setting")
    add_longest_arguments(parser)


def _add_step_arguments(step: Any) -> None:
    """The step's flags (`remat.estimate.StepSettings` fields)."""
    from typing import get_args

    from remat.distributed.choices import MIXED_PRECISION, STRATEGIES
    from remat.estimate.choices import LOSS_TARGETS, TARGETS
    from remat.models.config import AutocastDtype, ParamDtype

    step.add_argument("--batch-size", type=int, help="micro-batch per rank")
    step.add_argument("--seq-length", type=int, help="tokens per row")
    step.add_argument("--dtype", choices=get_args(ParamDtype), help="parameter dtype")
    step.add_argument("--autocast", choices=(*get_args(AutocastDtype), "none"), help="autocast dtype, or none")
    step.add_argument("--policy", help="activation checkpointing, as in a recipe: none, full, selective, attention, "
                                       "mlp, sqrt, or a YAML mapping such as '{mode: full, every_n_layers: 2}'")
    step.add_argument("--loss", choices=tuple(LOSS_TARGETS), help="plain cross-entropy on logits, or the fused "
                                                                 "linear cross-entropy")
    step.add_argument("--optimizer", help="optimizer class (default torch.optim.AdamW)")
    step.add_argument("--strategy", choices=STRATEGIES, help="single, ddp or fsdp2")
    step.add_argument("--world-size", type=int, help="processes (ddp / fsdp2): data-parallel x context-parallel x "
                                                    "tensor-parallel ranks")
    step.add_argument("--cp-size", type=int, help="context-parallel ranks sharing each row (the estimate is one "
                                                 "rank's); alone it means fsdp2 over that many processes")
    step.add_argument("--tp-size", type=int, help="tensor-parallel ranks splitting each block's weights (fsdp2 only; "
                                                 "the estimate is one rank's)")
    step.add_argument("--mixed-precision", choices=MIXED_PRECISION,
                      help="FSDP2 compute dtype of the gathered parameters (fsdp2 only)")
    step.add_argument("--grad-accumulation", type=int, help="micro-batches per optimizer step")
    step.add_argument("--documents-per-row", type=int,
                      help="packed documents per row (>1: attention runs per document; with "
                           "model.document_attention: false transformers builds a block-diagonal mask)")
    step.add_argument("--target", choices=TARGETS, help="model a CUDA GPU (default) or the CPU as it runs here")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from remat.recipes.run_safety.output_paths import check_output_file
    from remat.units import parse_capacity

    capacity = parse_capacity(args.fits) if args.fits else None  # said before torch loads
    for flag, value in (("--json", args.json), ("--plot", args.plot)):
        if value:
            check_output_file(Path(value), flag)
    from remat.commands.estimate_longest import check_arguments, longest_rows, run_longest
    from remat.estimate.api import estimate_memory
    from remat.estimate.report import breakdown_table, plot_breakdowns, print_comparison

    check_arguments(args)
    model, base = _base(args, overrides)
    base = _with_context_parallel(args, base)
    rows = _rows(args, base)
    if args.longest and capacity is not None:
        if args.compare:
            rows = longest_rows(rows, len(COMPARE_POLICIES) * len(COMPARE_LOSSES))
        return run_longest(args, model, rows, capacity)
    estimates = []
    if len(rows) > 1:
        logger.info("%d estimates to make, one per setting", len(rows))
    for index, (label, settings) in enumerate(rows, 1):
        logger.info("estimating %s%s", label or settings.describe(), f" ({index} of {len(rows)})" if len(rows) > 1 else "")
        estimate = estimate_memory(model, settings, label=label)
        logger.info("%s: peak %.2f GiB (%.1f s)", estimate.name, estimate.peak_bytes / 2**30, estimate.seconds)
        estimates.append(estimate)
    if args.compare:
        print_comparison(estimates, capacity_bytes=capacity, rich=sys.stdout.isatty())
    else:
        print(breakdown_table(estimates[0], capacity_bytes=capacity))
    if args.json:
        from remat.commands._output import write_json

        write_json(Path(args.json), [e.to_dict() for e in estimates] if args.compare else estimates[0].to_dict())
    if args.plot:
        logger.info("wrote %s", plot_breakdowns(estimates, args.plot, capacity_bytes=capacity))
    return 0


def _base(args: argparse.Namespace, overrides: list[str]) -> tuple[Any, Any]:
    """The model and the step the recipe (or preset / config and flags) describe."""
    from remat.errors import ConfigError
    from remat.estimate.api import resolve_model, settings_from_recipe
    from remat.estimate.settings import StepSettings

    flags = {name: _flag_value(name, getattr(args, flag)) for flag, name in _FLAGS if getattr(args, flag) is not None}
    from remat.commands._model_source import model_source

    source = model_source(args.recipe) if args.recipe is not None else None
    if source is not None:  # a Hub id or a model directory: its config.json only, never weights
        if args.preset or args.config or overrides:
            raise ConfigError(f"model: got {args.recipe!r} as well as --preset / --config or recipe overrides; give "
                              "one model (a Hub id or a model directory takes the step from the flags)")
        from remat.models import ModelConfig

        return resolve_model(ModelConfig(pretrained_model_name_or_path=source)), dataclasses.replace(
            StepSettings(), **flags)
    if args.recipe is not None and Path(args.recipe).is_dir():  # not a model directory (model_source said no)
        config = Path(args.recipe) / "config.json"
        what = ("has no config.json" if not (config.exists() or config.is_symlink())
                else f"has a config.json that is not a regular file ({config})")
        raise ConfigError(f"model: the directory {args.recipe!r} {what}; allowed: a model directory holding its "
                          "config.json, a config.json path (--config), a Hub id, a preset (--preset) or a YAML recipe")
    if args.recipe is not None:
        if args.preset or args.config:
            raise ConfigError(f"recipe: got {args.recipe!r} as well as --preset / --config; give one of them (a "
                              "recipe names its model; dotted recipe overrides need a recipe)")
        from remat.recipes.loader import load_recipe

        cfg = load_recipe(args.recipe, overrides, data_needed=False)
        if cfg.distributed.auto is not None and "policy" not in flags and not args.compare:
            raise ConfigError("distributed.activation_checkpointing: 'auto' is planned, not estimated: remat plan "
                              f"{args.recipe} prints the plan for its budget with its predicted peak; give --policy "
                              "to estimate one policy")
        model, settings = settings_from_recipe(cfg, **flags)
        return model, settings
    if overrides:
        raise ConfigError(f"unrecognized arguments: {' '.join(overrides)} (dotted recipe overrides need a recipe)")
    if not args.preset and not args.config:
        raise ConfigError("model: give a recipe, --preset NAME or --config PATH (see `remat estimate --help`)")
    model = resolve_model(args.preset or args.config)
    return model, dataclasses.replace(StepSettings(), **flags)


def _with_context_parallel(args: argparse.Namespace, settings: Any) -> Any:
    """``--cp-size N`` on a one-process step: FSDP2 over N processes, one row cut over all of them (said)."""
    if not args.cp_size or args.cp_size == 1 or settings.strategy != "single" or args.strategy:
        return settings
    world_size = args.world_size or args.cp_size
    logger.info("--cp-size %d: fsdp2 over %d processes (dp %d x cp %d); give --strategy / --world-size to change it",
                args.cp_size, world_size, world_size // args.cp_size, args.cp_size)
    changed = dataclasses.replace(settings, strategy="fsdp2", world_size=world_size)
    changed.validate()
    return changed


def _flag_value(name: str, value: Any) -> Any:
    if name == "autocast" and value == "none":
        return None
    if name == "policy":
        return _yaml_value(value)
    return value


def _rows(args: argparse.Namespace, base: Any) -> list[tuple[str, Any]]:
    """(label, settings) of each estimate to make."""
    from remat.errors import ConfigError

    extra = [(spec, _apply_setting(base, spec)) for spec in args.setting]
    if not args.compare:
        if len(extra) > 1:
            raise ConfigError("--setting: several settings need --compare (one row each); without it give one")
        return [("", extra[0][1] if extra else base)]
    rows = [(f"{policy} + {loss}", dataclasses.replace(base, policy=policy, loss=loss,
                                                        loss_kwargs=base.loss_kwargs if loss == base.loss else {}))
            for policy in COMPARE_POLICIES for loss in COMPARE_LOSSES]
    return rows + extra


def _apply_setting(base: Any, spec: str) -> Any:
    from remat.errors import ConfigError
    from remat.estimate.settings import StepSettings

    names = {f.name for f in dataclasses.fields(StepSettings) if f.name != "base"}
    changes: dict[str, Any] = {}
    for item in _split_top_level(spec):
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--setting: got {item!r} in {spec!r}; allowed: KEY=VALUE items separated by commas")
        if key not in names:
            raise ConfigError(f"--setting: unknown key {key!r} in {spec!r}; allowed: {', '.join(sorted(names))}")
        changes[key] = _yaml_value(raw.strip())
    if "loss" in changes and changes["loss"] != base.loss:
        changes.setdefault("loss_kwargs", {})
    settings = dataclasses.replace(base, **changes)
    settings.validate()
    return settings


def _split_top_level(spec: str) -> list[str]:
    """Split on commas that are not inside braces or brackets (YAML mappings and lists keep theirs)."""
    items, depth, current = [], 0, ""
    for char in spec:
        depth += char in "{["
        depth -= char in "}]"
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return [item for item in items if item.strip()]


def _yaml_value(raw: str) -> Any:
    import yaml

    from remat.errors import ConfigError

    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"--setting / --policy: {raw!r} is not a YAML value: {err}") from err
