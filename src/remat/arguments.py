"""Unknown keyword arguments named with the closest allowed one, for recipes and for Python calls alike.

``@checked_keywords`` on a public constructor turns ``FusedLinearCrossEntropy(chunk_sz=4)`` from Python's bare
``TypeError: unexpected keyword argument`` into a `ConfigError` that names the argument, suggests ``chunk_size`` and
lists what is allowed; `unknown_argument_hint` is the same suggestion for the recipe loader.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from remat.errors import ConfigError

#: Names people often write for an argument that has another name in torch or remat.
COMMON_SYNONYMS: dict[str, str] = {"learning_rate": "lr", "wd": "weight_decay", "beta": "betas", "epsilon": "eps",
                                   "chunk_sz": "chunk_size", "chunksize": "chunk_size"}

F = TypeVar("F", bound=Callable[..., Any])


def unknown_argument_hint(name: str, allowed: Sequence[str]) -> str:
    """``"; did you mean 'x'?"`` for the allowed name closest to ``name`` (or a known synonym), else ``"."``."""
    synonym = COMMON_SYNONYMS.get(name)
    close = [synonym] if synonym in allowed else difflib.get_close_matches(name, list(allowed), n=1)
    return f"; did you mean {close[0]!r}?" if close else "."


def checked_keywords(init: F) -> F:
    """Decorate an ``__init__`` so that an unknown keyword argument is a ConfigError with a suggestion."""
    signature = inspect.signature(init)
    accepted = [n for n, p in signature.parameters.items()
                if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        unknown = [name for name in kwargs if name not in accepted]
        if unknown:
            owner = type(self).__name__
            raise ConfigError(f"{owner}({unknown[0]}=...): unknown argument{unknown_argument_hint(unknown[0], accepted)} "
                              f"Allowed: {', '.join(accepted)}")
        return init(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
