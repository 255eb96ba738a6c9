"""Resolve and build the ``_target_`` entries of a recipe without ever running code the allow-list does not mean.

A recipe is data that people share, so naming a callable in it must not be a way to run arbitrary code. A target
resolves only if all of these hold, checked in this order and before anything is called:

1. Every dotted part is public (no ``_`` prefix), and the path lies in an allowed package: ``remat``, ``torch``,
   ``transformers``, ``peft``, plus the packages the person running the recipe names in ``custom_target_packages``
   (a command-line override or the Python API; a recipe file cannot widen the list itself, see
   ``remat.recipes.loader``). The standard library is never allowed.
2. The path is a real module followed by one attribute of it: attributes that are themselves modules (``torch.os``,
   the ``os`` module re-exported) are refused, so the allow-list cannot be left through a module's globals.
3. The object is a class or a function whose *defining* module is inside the allowed packages.
4. It is the kind of object the key expects (:class:`TargetKind`): an optimizer class for ``optimizer``, a loss that
   declares what it consumes for ``loss_fn``.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from remat.arguments import unknown_argument_hint
from remat.errors import ConfigError

ALLOWED_PACKAGES: tuple[str, ...] = ("remat", "torch", "transformers", "peft")

# Names users carry over from other trainers, for "did you mean" hints that spelling distance would miss.
@dataclass(frozen=True)
class TargetKind:
    """What a recipe key may build: ``accepts(obj)`` decides, ``what`` says it in error messages."""

    what: str
    accepts: Callable[[Any], bool]


ANY_CALLABLE = TargetKind("a class or function", callable)


def _is_optimizer_class(obj: Any) -> bool:
    import torch

    return inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer)


def _is_loss_class(obj: Any) -> bool:
    from remat.loss import loss_input

    return inspect.isclass(obj) and loss_input(obj) is not None


OPTIMIZER = TargetKind("an optimizer class (a subclass of torch.optim.Optimizer, e.g. torch.optim.AdamW)",
                       _is_optimizer_class)
LOSS = TargetKind("a loss class that declares what it consumes (consumes = 'logits' or 'hidden_states'), such as "
                  "remat.loss.MaskedCrossEntropy or remat.loss.FusedLinearCrossEntropy", _is_loss_class)

# The recipe sections built from a ``_target_``: the kind each must be, and the arguments remat passes itself.
SECTION_KINDS: dict[str, TargetKind] = {"optimizer": OPTIMIZER, "loss_fn": LOSS}
PROVIDED_ARGS: dict[str, tuple[str, ...]] = {"optimizer": ("params",), "loss_fn": ()}


def check_custom_packages(packages: Iterable[str], *, key: str = "custom_target_packages") -> tuple[str, ...]:
    """Validate the extra packages a user trusts for ``_target_``: importable names, never the standard library."""
    checked = []
    for name in packages:
        parts = name.split(".") if isinstance(name, str) else []
        if not parts or not all(p.isidentifier() and not p.startswith("_") for p in parts):
            raise ConfigError(f"{key}: {name!r} is not a package name such as 'my_project.losses'")
        if parts[0] in sys.stdlib_module_names or parts[0] == "builtins":
            raise ConfigError(f"{key}: {name!r} is part of Python's standard library, which is never allowed "
                              "(it reaches the shell, files and the interpreter)")
        checked.append(name)
    return tuple(checked)


def _inside(name: str, packages: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def resolve_target(path: str, *, key: str, kind: TargetKind = ANY_CALLABLE,
                   custom_packages: Iterable[str] = ()) -> Callable[..., Any]:
    """Import the class or function named by a dotted ``path`` such as ``torch.optim.AdamW``, checked as above.

    ``key`` is the dotted recipe key used in error messages (e.g. ``optimizer._target_``). Nothing named by
    ``path`` is called; only the modules on its path are imported, and only inside the allowed packages.
    """
    packages = ALLOWED_PACKAGES + check_custom_packages(custom_packages)
    if not isinstance(path, str) or "." not in path:
        raise ConfigError(f"{key}: expected a dotted import path such as 'torch.optim.AdamW', got {path!r}")
    parts = path.split(".")
    if not all(p.isidentifier() for p in parts):
        raise ConfigError(f"{key}: {path!r} is not a dotted import path")
    private = [p for p in parts if p.startswith("_")]
    if private:
        raise ConfigError(f"{key}: {path!r} names the private attribute {private[0]!r}; targets must be public "
                          "classes or functions")
    if not _inside(path, packages):
        allowed = ", ".join(p + ".*" for p in packages)
        raise ConfigError(
            f"{key}: {path!r} is outside the allowed packages ({allowed}); to build your own class, name its "
            "package when you run the recipe: --custom_target_packages '[my_package]'"
        )
    module, attr = _import_module_prefix(path, parts, key, packages)
    obj = _public_attribute(module, attr, path, key)
    defined_in = getattr(obj, "__module__", None) or ""
    if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)) or not callable(obj):
        raise ConfigError(f"{key}: {path!r} is a {type(obj).__name__}, not a class or function")
    if not _inside(defined_in, packages):
        raise ConfigError(f"{key}: {path!r} is defined in {defined_in or 'an unknown module'!r}, outside the "
                          f"allowed packages; it is only re-exported by {module.__name__!r}")
    if not kind.accepts(obj):
        raise ConfigError(f"{key}: {path!r} is not {kind.what}")
    return obj


def _import_module_prefix(path: str, parts: list[str], key: str,
                          packages: tuple[str, ...]) -> tuple[ModuleType, str]:
    """Import ``parts[:-1]`` as a module (by its real name, never through attributes) and return it and the last part."""
    module_path, attr = ".".join(parts[:-1]), parts[-1]
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as err:
        if err.name is not None and not module_path.startswith(err.name):
            raise  # the module exists but one of its own imports is missing: a real bug, keep the traceback
        parent = module_path.rsplit(".", 1)[0]
        hint = ""
        try:
            parent_mod = importlib.import_module(parent) if parent != module_path else None
        except ImportError:
            parent_mod = None
        leaf = module_path.rsplit(".", 1)[-1]
        if parent_mod is not None and isinstance(getattr(parent_mod, leaf, None), ModuleType):
            real = getattr(parent_mod, leaf).__name__
            raise ConfigError(f"{key}: {path!r} reaches the module {real!r} through an attribute of {parent!r}; "
                              "targets must name a class or function by the module that defines it") from None
        if parent_mod is not None:
            close = difflib.get_close_matches(leaf, [n for n in dir(parent_mod) if not n.startswith("_")])
            hint = f"; did you mean {' or '.join(repr(parent + '.' + c) for c in close)}?" if close else ""
        raise ConfigError(f"{key}: cannot import {path!r}: no module {module_path!r}{hint}") from None
    if not _inside(module.__name__, packages):
        raise ConfigError(f"{key}: {module_path!r} is the module {module.__name__!r}, outside the allowed packages")
    return module, attr


def _public_attribute(module: ModuleType, attr: str, path: str, key: str) -> Any:
    if not hasattr(module, attr):
        public = [n for n in dir(module) if not n.startswith("_")]
        close = [f"{module.__name__}.{c}" for c in difflib.get_close_matches(attr, public)]
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ConfigError(f"{key}: {path!r} not found: {module.__name__!r} has no attribute {attr!r}{hint}")
    obj = getattr(module, attr)
    if isinstance(obj, ModuleType):
        raise ConfigError(f"{key}: {path!r} is a module ({obj.__name__!r}), not a class or function")
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
            hint = unknown_argument_hint(name, allowed)
            raise ConfigError(
                f"{section}.{name}: unknown argument of {fn.__module__}.{getattr(fn, '__qualname__', fn)}{hint} "
                f"Allowed: {', '.join(allowed)}"
            )


def build_target(path: str, kwargs: dict[str, Any], *, key: str, kind: TargetKind = ANY_CALLABLE,
                 custom_packages: Iterable[str] = (), **provided: Any) -> Any:
    """Resolve ``path``, check ``kwargs`` against its signature and call it with ``kwargs`` plus ``provided``."""
    fn = resolve_target(path, key=key, kind=kind, custom_packages=custom_packages)
    check_kwargs(fn, kwargs, key=key, provided=tuple(provided))
    try:
        return fn(**provided, **kwargs)
    except (TypeError, ValueError) as err:
        section = key.rsplit(".", 1)[0]
        raise ConfigError(f"{section}: building {path} failed: {err}") from err
