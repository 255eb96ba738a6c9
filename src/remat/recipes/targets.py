"""Resolve and build ``_target_`` entries of a recipe, restricted to trusted module prefixes.

A recipe is data; naming arbitrary importable callables in it would let a YAML file run any code. Only targets under
``ALLOWED_PREFIXES`` are built unless the recipe sets ``allow_custom_targets: true``.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from remat.errors import ConfigError

ALLOWED_PREFIXES: tuple[str, ...] = ("remat.", "torch.", "transformers.", "peft.")

# Names users carry over from other trainers, for "did you mean" hints that spelling distance would miss.
COMMON_SYNONYMS: dict[str, str] = {"learning_rate": "lr", "wd": "weight_decay", "beta": "betas", "epsilon": "eps"}


def resolve_target(path: str, *, key: str, allow_custom: bool = False) -> Callable[..., Any]:
    """Import the object named by a dotted ``path`` such as ``torch.optim.AdamW``.

    ``key`` is the dotted recipe key used in error messages (e.g. ``optimizer._target_``).
    """
    if not isinstance(path, str) or "." not in path:
        raise ConfigError(f"{key}: expected a dotted import path such as 'torch.optim.AdamW', got {path!r}")
    if not allow_custom and not path.startswith(ALLOWED_PREFIXES):
        allowed = ", ".join(p + "*" for p in ALLOWED_PREFIXES)
        raise ConfigError(
            f"{key}: {path!r} is outside the allowed modules ({allowed}); "
            "set 'allow_custom_targets: true' at the top of the recipe to build it anyway"
        )
    parts = path.split(".")
    obj: Any = None
    for split in range(len(parts) - 1, 0, -1):
        module_path, attr_path = ".".join(parts[:split]), parts[split:]
        try:
            obj = importlib.import_module(module_path)
        except ModuleNotFoundError as err:
            if err.name is not None and not module_path.startswith(err.name):
                raise  # the module exists but one of its own imports is missing: a real bug, keep the traceback
            continue
        for i, attr in enumerate(attr_path):
            if not hasattr(obj, attr):
                public = [n for n in dir(obj) if not n.startswith("_")]
                close = [".".join([module_path, *attr_path[:i], c]) for c in difflib.get_close_matches(attr, public)]
                hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
                raise ConfigError(f"{key}: {path!r} not found: {module_path!r} has no attribute {attr!r}{hint}")
            obj = getattr(obj, attr)
        break
    else:
        raise ConfigError(f"{key}: cannot import {path!r}: no module {parts[0]!r}")
    if not callable(obj):
        raise ConfigError(f"{key}: {path!r} is not a class or function")
    return obj


def check_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any], *, key: str, provided: tuple[str, ...] = ()) -> None:
    """Raise ``ConfigError`` if ``kwargs`` holds names that ``fn`` does not accept.

    ``provided`` names the arguments the recipe passes itself (e.g. ``params`` for an optimizer); the user may not set
    them.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: nothing to check
        return
    params = sig.parameters
    takes_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = [n for n, p in params.items() if p.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                                 inspect.Parameter.VAR_KEYWORD)]
    section = key.rsplit(".", 1)[0]
    for name in kwargs:
        if name in provided:
            raise ConfigError(f"{section}.{name}: set by remat itself, remove it from the recipe")
        if name not in params and not takes_var_kw:
            allowed = [n for n in accepted if n not in provided and n != "self"]
            synonym = COMMON_SYNONYMS.get(name)
            close = [synonym] if synonym in allowed else difflib.get_close_matches(name, allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise ConfigError(
                f"{section}.{name}: unknown argument of {fn.__module__}.{getattr(fn, '__qualname__', fn)}{hint} "
                f"Allowed: {', '.join(allowed)}"
            )


def build_target(path: str, kwargs: dict[str, Any], *, key: str, allow_custom: bool = False,
                 **provided: Any) -> Any:
    """Resolve ``path``, check ``kwargs`` against its signature and call it with ``kwargs`` plus ``provided``."""
    fn = resolve_target(path, key=key, allow_custom=allow_custom)
    check_kwargs(fn, kwargs, key=key, provided=tuple(provided))
    try:
        return fn(**provided, **kwargs)
    except (TypeError, ValueError) as err:
        section = key.rsplit(".", 1)[0]
        raise ConfigError(f"{section}: building {path} failed: {err}") from err
