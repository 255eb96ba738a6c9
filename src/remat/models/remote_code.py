"""What ``trust_remote_code`` would run for a model source: the Python files its ``config.json`` names in
``auto_map`` (read as data, no transformers import), for the one line that refuses a recipe that switches it on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from remat._files import printable, read_regular_bytes

_MAX_CONFIG_BYTES = 16 * 1024**2


def remote_code_files(source: str) -> list[str]:
    """The modelling files ``trust_remote_code`` would import for `source`: for a local directory, the ``.py`` files
    its ``config.json``'s ``auto_map`` names (and any other ``.py`` file there); for a Hub id, a description of the
    repository's. Empty when nothing would run that can be named."""
    directory = Path(source).expanduser()
    if not directory.is_dir():
        return [f"the Python files of the Hub repository {printable(source, 100)!r} that its config's auto_map names"]
    named: list[str] = []
    try:
        config = json.loads(read_regular_bytes(directory / "config.json", "model config", limit=_MAX_CONFIG_BYTES))
    except Exception:  # noqa: BLE001 (the refusal names what it can; the config is checked again when it is built)
        config = None
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    for reference in _references(auto_map):
        repo, _, dotted = reference.rpartition("--")
        module = dotted.rsplit(".", 1)[0]
        where = f"{module}.py of the Hub repository {repo!r}" if repo else str(directory / f"{module}.py")
        if where not in named:
            named.append(printable(where, 200))
    for extra in sorted(directory.glob("*.py")):
        if str(extra) not in named:
            named.append(printable(str(extra), 200))
    return named


def _references(auto_map: Any) -> list[str]:
    """The ``module.Class`` references of an ``auto_map`` (values are a string or a list of strings or None)."""
    if not isinstance(auto_map, dict):
        return []
    found: list[str] = []
    for value in auto_map.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and "." in item:
                found.append(item)
    return found
