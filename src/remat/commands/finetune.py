"""``remat finetune RECIPE [--nproc-per-node N ...] [--dotted.key VALUE ...]``: validate a recipe and train, in this
process or in worker processes started by torchrun."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from pydantic import BaseModel

NAME = "finetune"

DESCRIPTION = """\
Fine-tune a causal LM from a YAML recipe. Any recipe key can be overridden on the command line with its dotted
name, e.g.:
  remat finetune examples/quickstart.yaml --step_scheduler.max_steps 10
  remat finetune examples/quickstart.yaml --distributed.activation_checkpointing=selective
  remat finetune examples/quickstart.yaml --distributed.activation_checkpointing '{mode: full, every_n_layers: 2}'
Values are read as YAML (true, 3e-4, [a, b], {k: v}). The recipe is validated before anything is built.

Several processes (distributed.strategy ddp or fsdp2) are started through torchrun:
  remat finetune examples/fsdp2_quickstart.yaml --nproc-per-node 2
  remat finetune recipe.yaml --nproc-per-node 8 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500
A recipe already running under torchrun (torchrun ... -m remat.cli finetune recipe.yaml) is not launched again.
"""


def register(subparsers: Any) -> None:
    from remat.distributed.launch import add_launch_arguments
    from remat.recipes.config import RecipeConfig

    parser = subparsers.add_parser(
        NAME, help="fine-tune a causal LM from a YAML recipe", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="recipe keys (dotted name, type, default):\n" + "\n".join(schema_lines(RecipeConfig)),
    )
    parser.add_argument("recipe", help="path of the YAML recipe (see examples/ and docs/recipes.md)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the validated recipe with every default filled in, then exit")
    add_launch_arguments(parser)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    import yaml

    from remat.distributed.env import ProcessEnv, check_cuda_devices
    from remat.distributed.launch import LaunchOptions, check_launch_environment, launch
    from remat.recipes.finetune import FinetuneRecipe, check_parallel_layout
    from remat.recipes.loader import load_recipe

    options = LaunchOptions.from_namespace(args)
    options.check()  # impossible launcher values are refused before anything is read or started
    cfg = load_recipe(args.recipe, overrides)
    if args.print_config:
        print(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False), end="")
        return 0
    if check_launch_environment(options):
        world_size = options.num_processes()
        if world_size is not None:  # say what is wrong once, before any worker starts
            check_parallel_layout(cfg, world_size)
        if cfg.distributed.device == "cuda" and (options.nproc_per_node or "1").isdigit():
            check_cuda_devices(int(options.nproc_per_node or "1"))
        worker = ["-m", "remat.cli", "--log-level", args.log_level, NAME, args.recipe, *overrides]
        return launch(options, worker)
    if ProcessEnv.from_environ().rank != 0:  # only rank 0 reports; the others say only what goes wrong
        logging.getLogger("remat").setLevel(logging.WARNING)
    recipe = FinetuneRecipe(cfg)
    try:
        result = recipe.run()
    finally:
        recipe.dist.close()
    return result.exit_code


def schema_lines(model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per recipe key: dotted name, type and default (read from the pydantic schema)."""
    lines = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        nested = _nested_model(info.annotation)
        if nested is not None:
            optional = not info.is_required() and info.default is None
            lines.append(f"  {key}:" + ("  (optional section)" if optional else ""))
            lines.extend(schema_lines(nested, key + "."))
            continue
        type_name = str(info.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
        default = "required" if info.is_required() else f"default {info.get_default(call_default_factory=True)!r}"
        lines.append(f"  {key}  [{type_name}]  {default}")
        if model.model_config.get("extra") == "allow" and name == "target":
            lines.append(f"  {prefix}<argument>  other keys are keyword arguments of the _target_")
    return lines


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
