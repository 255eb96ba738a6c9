"""Lazy re-exports for package ``__init__`` modules (PEP 562).

A package lists what it re-exports and from which submodule; the submodule is imported on first access of the name.
So importing one light submodule (``remat.checkpointing.policy``, ``remat.models.config``) does not load torch or
transformers through its package's ``__init__``: ``remat --help`` and a recipe with a typo answer without them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each public name to the module defining it
    (absolute, or relative to the package when it starts with a dot), or a submodule to itself (``"loss":
    "remat.loss"``). The value is cached in the package."""
    module_globals = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(source, package)
        value = module if module.__name__ == f"{package}.{name}" else getattr(module, name)  # a submodule itself
        module_globals[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*module_globals, *exports})

    return __getattr__, __dir__
