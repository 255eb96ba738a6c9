"""Keeping a component's INFO lines out of a run that says the same thing itself."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_log(name: str) -> Iterator[None]:
    """The logger ``name`` at WARNING at least for the block: what a build or a plan says at INFO is the caller's to
    say once (the recipe's setup report prints the checkpointing table; a `remat plan` simulates a dozen steps)."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(level)


_said: set[str] = set()


def warn_once(log: logging.Logger, message: str, *args: object) -> None:
    """``log.warning(message % args)`` once per process: an ``auto`` run validates its recipe more than once (the
    planned recipe, each worker), and the same advice three times is noise."""
    text = message % args
    if text not in _said:
        _said.add(text)
        log.warning(text)
