"""``remat recipes [copy NAME [DEST] [--force]]``: list the example recipes that ship with remat, or copy one out
to edit (``remat finetune NAME`` runs one as it is, from any directory)."""

from __future__ import annotations

import argparse
from typing import Any

NAME = "recipes"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        NAME, help="list the shipped example recipes, or copy one out to edit",
        description="Without arguments: list the example recipes that ship with remat (run one with `remat finetune "
                    "NAME`). `remat recipes copy NAME [DEST]` writes NAME.yaml into DEST (a directory, default the "
                    "current one, or a file path).",
    )
    parser.add_argument("action", nargs="?", choices=["list", "copy"], default="list")
    parser.add_argument("name", nargs="?", help="copy: the recipe to copy (a name from the list)")
    parser.add_argument("destination", nargs="?", help="copy: a directory or a file path (default: .)")
    parser.add_argument("--force", action="store_true", help="copy: replace an existing file")


def run(args: argparse.Namespace, extra: list[str]) -> int:
    from remat.errors import ConfigError
    from remat.recipes.shipped import copy_recipe, shipped_recipes

    if extra:
        raise ConfigError(f"recipes: unexpected arguments {' '.join(extra)}; usage: remat recipes [copy NAME [DEST]]")
    if args.action == "list":
        if args.name is not None:
            raise ConfigError(f"recipes: unexpected argument {args.name!r}; to copy one: remat recipes copy NAME")
        recipes = shipped_recipes()
        width = max(len(name) for name in recipes)
        for recipe in recipes.values():
            print(f"{recipe.name:<{width}}  {recipe.summary}")
        print("\nrun one: remat finetune NAME    copy one to edit: remat recipes copy NAME [DEST]")
        return 0
    if args.name is None:
        raise ConfigError("recipes copy: which recipe? usage: remat recipes copy NAME [DEST] (remat recipes lists them)")
    written = copy_recipe(args.name, args.destination, overwrite=args.force)
    print(f"wrote {written}; run it with: remat finetune {written}")
    return 0
