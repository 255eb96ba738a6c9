"""The example recipes that ship inside the package (``remat/examples/*.yaml``, the repository's ``examples/``).

``remat finetune quickstart`` runs the shipped quickstart from any directory; ``remat recipes`` lists them and
``remat recipes copy NAME [DEST]`` writes one out to edit. A recipe argument is a file path first: a name only
means a shipped recipe when no such file exists.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from remat._files import shown
from remat.errors import ConfigError


@dataclass(frozen=True)
class ShippedRecipe:
    """One shipped example: its name (the file stem), where it is, and the first line of its header comment."""

    name: str
    path: Path
    summary: str


def shipped_recipes() -> dict[str, ShippedRecipe]:
    """The shipped examples by name, sorted."""
    folder = Path(str(resources.files("remat") / "examples"))
    found = {}
    for path in sorted(folder.glob("*.yaml")):
        found[path.stem] = ShippedRecipe(path.stem, path, _summary(path.read_text()))
    return found


def _summary(text: str, width: int = 100) -> str:
    """The first sentence of a recipe's header comment, at most ``width`` characters."""
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    sentence = " ".join(header).split(". ")[0].split(":   ")[0].strip()
    return sentence if len(sentence) <= width else sentence[: width - 3].rstrip() + "..."


def find_recipe(argument: str | Path) -> Path:
    """The recipe file ``argument`` names: an existing path, else ``NAME.yaml`` in the current directory for a bare
    name (the copy ``remat recipes copy NAME`` wrote, which the user may have edited), else a shipped recipe's name
    (``quickstart`` or ``quickstart.yaml``); ConfigError listing the shipped names when it is none of these."""
    path = Path(argument)
    try:
        if path.exists() or path.is_symlink():
            return path
        if not path.suffix and len(path.parts) == 1 and path.with_suffix(".yaml").is_file():
            return path.with_suffix(".yaml")
    except (ValueError, OSError) as err:  # a NUL byte, a name too long for the file system
        raise ConfigError(f"recipe {shown(os.fspath(argument))}: not a usable path ({err}); give the path of a YAML "
                          "recipe or a shipped recipe's name") from None
    shipped = shipped_recipes()
    name = path.name.removesuffix(".yaml").removesuffix(".yml")
    if len(path.parts) == 1 and name in shipped:
        return shipped[name].path
    raise ConfigError(f"recipe {shown(os.fspath(argument))} not found: not a file, nor a shipped recipe; shipped: "
                      f"{', '.join(shipped)} (remat recipes lists them)")


def copy_recipe(name: str, destination: str | Path | None = None, *, overwrite: bool = False) -> Path:
    """Copy the shipped recipe ``name`` to ``destination`` (a file, or a directory to put ``<name>.yaml`` in; default
    the current directory) and return the written path; refuses to replace a file unless ``overwrite``."""
    shipped = shipped_recipes()
    key = name.removesuffix(".yaml")
    if key not in shipped:
        raise ConfigError(f"recipe {name!r}: not a shipped recipe; shipped: {', '.join(shipped)}")
    target = Path(destination) if destination is not None else Path.cwd()
    if target.is_dir():
        target = target / f"{key}.yaml"
    if target.exists() and not overwrite:
        raise ConfigError(f"{target}: already exists; choose another destination or pass --force to replace it")
    if not target.parent.is_dir():
        raise ConfigError(f"{target}: the directory {target.parent} does not exist")
    shutil.copyfile(shipped[key].path, target)
    return target
