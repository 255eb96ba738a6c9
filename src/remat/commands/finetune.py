"""``remat finetune RECIPE [--dotted.key VALUE ...]``: validate a recipe and train."""

from __future__ import annotations

import argparse
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
"""


def register(subparsers: Any) -> None:
    from remat.recipes.config import RecipeConfig

    parser = subparsers.add_parser(
        NAME, help="fine-tune a causal LM from a YAML recipe", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="recipe keys (dotted name, type, default):\n" + "\n".join(schema_lines(RecipeConfig)),
    )
    parser.add_argument("recipe", help="path of the YAML recipe (see examples/ and docs/recipes.md)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the validated recipe with every default filled in, then exit")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    import yaml

    from remat.recipes.finetune import FinetuneRecipe
    from remat.recipes.loader import load_recipe

    cfg = load_recipe(args.recipe, overrides)
    if args.print_config:
        print(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False), end="")
        return 0
    FinetuneRecipe(cfg).run()
    return 0


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
