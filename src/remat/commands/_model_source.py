"""Whether a command's positional argument names a model (a Hub id, a model directory) rather than a recipe."""

from __future__ import annotations

from pathlib import Path


def model_source(argument: str) -> str | None:
    """``argument`` when it names a model rather than a recipe: a directory holding ``config.json``, or a Hub id
    (``org/name``) that is not a file or a shipped recipe's name."""
    from remat.hub import is_hub_id
    from remat.recipes.shipped import shipped_recipes

    path = Path(argument).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return argument
    if path.exists() or argument.removesuffix(".yaml") in shipped_recipes() or "/" not in argument:
        return None
    return argument if is_hub_id(argument) else None
