"""Pydantic's validation errors as remat's messages: one line per problem, naming the dotted key, what was given and
what is allowed (the recipe loader's, and any config section validated on its own, e.g. `DistributedSetup.build`'s)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError

from remat._files import printable
from remat.errors import RematError


def format_validation_error(err: ValidationError, root: type[BaseModel]) -> str:
    """A recipe's problems, one line each under ``invalid recipe:`` (`validation_lines`)."""
    return "invalid recipe:\n  " + "\n  ".join(validation_lines(err, root))


def validation_lines(err: ValidationError, root: type[BaseModel], *, prefix: str = "") -> list[str]:
    """One line per problem: ``dotted.key: what is wrong (got X); allowed: ...; did you mean ...?``, each key under
    ``prefix`` (the section ``root`` is nested in, e.g. ``distributed``)."""
    lines = []
    for item in err.errors():
        loc = [str(p) for p in item["loc"] if not _is_union_tag(p)]
        shown_loc = [prefix, *loc] if prefix else loc
        key = printable(".".join(shown_loc)) or "<recipe>"  # a key may hold escape sequences: shown, never sent raw
        line = _describe(item, loc, key, root, prefix)
        if line not in lines:
            lines.append(line)
    return lines


def _is_union_tag(part: Any) -> bool:
    # pydantic adds the union member's type name (e.g. 'bool', 'str', 'dict[str,any]') to the location; a key the
    # user wrote (which may hold '[' too) is not of that form.
    return isinstance(part, str) and (part in {"bool", "str", "int", "float", "list", "dict"}
                                      or _UNION_TAG.match(part) is not None)


_UNION_TAG = re.compile(r"^(?:[a-z]+|literal|function-[a-z]+)\[.*\]$", re.DOTALL)


def _describe(item: Mapping[str, Any], loc: list[str], key: str, root: type[BaseModel], prefix: str) -> str:
    kind = item["type"]
    given = item.get("input")
    if kind == "extra_forbidden":
        allowed = _allowed_keys(root, loc[:-1])
        close = difflib.get_close_matches(loc[-1], allowed, n=1, cutoff=0.6)
        where = [prefix, *loc[:-1]] if prefix else loc[:-1]
        hint = f" (did you mean {'.'.join([*where, close[0]])!r}?)" if close else ""
        return f"{key}: unknown key{hint}; allowed keys here: {', '.join(allowed)}"
    if kind == "missing":
        return f"{key}: required key is missing"
    if kind == "string_type" and isinstance(given, (int, float)) and not isinstance(given, bool):
        return f"{key}: expected text, got the number {given!r}; write it in quotes in YAML: {key.split('.')[-1]}: '{given}'"
    if kind == "literal_error":
        expected = item.get("ctx", {}).get("expected", "")
        return f"{key}: got {given!r}; allowed: {expected}"
    msg = item["msg"]
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
    if isinstance(item.get("ctx", {}).get("error"), RematError):
        return str(item["ctx"]["error"])
    return f"{key}: {msg} (got {given!r})" if not isinstance(given, dict) else f"{key}: {msg}"


def _allowed_keys(root: type[BaseModel], loc: list[str]) -> list[str]:
    model: Any = root
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return []
        model = model_of(fields[part].annotation)
    fields = getattr(model, "model_fields", {})
    return [(f.alias or name) for name, f in fields.items()]


def model_of(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is not None or getattr(annotation, "__args__", None):
        for arg in get_args(annotation):
            found = model_of(arg)
            if found is not None:
                return found
    return None
