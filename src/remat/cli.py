"""The ``remat`` command line: ``remat finetune RECIPE [--dotted.key VALUE ...]``.

User mistakes (``remat.errors.RematError``) are printed as one message without a traceback and exit with status 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from remat import __version__
from remat.errors import RematError

FINETUNE_HELP = """\
Fine-tune a causal LM from a YAML recipe. Any recipe key can be overridden on the command line with its dotted
name, e.g.:
  remat finetune examples/quickstart.yaml --step_scheduler.max_steps 10
  remat finetune examples/quickstart.yaml --distributed.activation_checkpointing=selective
  remat finetune examples/quickstart.yaml --distributed.activation_checkpointing '{mode: full, every_n_layers: 2}'
Values are read as YAML (true, 3e-4, [a, b], {k: v}). The recipe is validated before anything is built.
"""


def _schema_lines(model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per recipe key: dotted name, type and default (from the pydantic schema)."""
    lines = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        annotation = info.annotation
        nested = _nested_model(annotation)
        if nested is not None:
            lines.append(f"  {key}:" + ("  (optional section)" if not info.is_required() and info.default is None else ""))
            lines.extend(_schema_lines(nested, key + "."))
            continue
        type_name = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
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


def build_parser() -> argparse.ArgumentParser:
    from remat.recipes.config import RecipeConfig

    parser = argparse.ArgumentParser(
        prog="remat",
        description="remat: memory-efficient fine-tuning of causal LMs (activation checkpointing, fused loss).",
    )
    parser.add_argument("--version", action="version", version=f"remat {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="verbosity of remat's own log messages (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    finetune = sub.add_parser(
        "finetune", help="fine-tune a causal LM from a YAML recipe",
        description=FINETUNE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="recipe keys (dotted name, type, default):\n" + "\n".join(_schema_lines(RecipeConfig)),
    )
    finetune.add_argument("recipe", help="path of the YAML recipe (see examples/ and docs/recipes.md)")
    finetune.add_argument("--print-config", action="store_true",
                          help="print the validated recipe with every default filled in, then exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), format="[remat] %(levelname)s %(message)s",
                        stream=sys.stderr)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "finetune":
            return _finetune(args, rest)
    except RematError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


def _finetune(args: argparse.Namespace, overrides: list[str]) -> int:
    import yaml

    from remat.recipes.finetune import FinetuneRecipe
    from remat.recipes.loader import load_recipe

    cfg = load_recipe(args.recipe, overrides)
    if args.print_config:
        print(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False), end="")
        return 0
    FinetuneRecipe(cfg).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
