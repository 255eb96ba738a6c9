"""The memory budget a plan must fit: bytes, a size (``"40GiB"``), or a fraction of the device's memory.

Without a budget on a GPU, the budget is the device's total memory minus `DEFAULT_MARGIN` of it: the estimate
predicts what ``torch.cuda.max_memory_allocated`` reports, and the allocator's reserved-but-unused blocks, the CUDA
context and library workspaces live in that margin. On the CPU there is no device total to start from, so a budget
must be given.
"""

from __future__ import annotations

from typing import Any, Final

from remat.errors import ConfigError
from remat.units import parse_capacity

DEFAULT_MARGIN: Final[float] = 0.10
"""The share of a GPU's memory left out of the default budget (see the module docstring)."""

MIN_BUDGET: Final[int] = 2**20
"""Budgets below this (1 MiB) are taken for a forgotten unit."""

BudgetLike = int | float | str | None


def parse_budget(value: BudgetLike, *, device_bytes: int | None, key: str = "memory_budget") -> int:
    """The budget in bytes. ``value``: an integer number of bytes, a size with a unit (``"40GiB"``, ``"24GB"``),
    a fraction of ``device_bytes`` in (0, 1] (``0.8``), or None for the default (the device's total minus
    `DEFAULT_MARGIN`). Raises `ConfigError` naming ``key`` for anything else, and for a fraction or the default
    without a device total (planning for the CPU)."""
    if value is None:
        if device_bytes is None:
            raise ConfigError(f"{key}: required here: planning for the CPU, or for a GPU this machine does not have, "
                              "leaves no device memory to take a default from; give bytes or a size such as 8GiB")
        return int(device_bytes * (1 - DEFAULT_MARGIN))
    if isinstance(value, bool):
        raise ConfigError(f"{key}: got {value!r}; {_ALLOWED}")
    if isinstance(value, int):
        if value < MIN_BUDGET:
            raise ConfigError(f"{key}: got {value} bytes, less than 1 MiB; write a unit (e.g. {value}GiB); {_ALLOWED}")
        return value
    if isinstance(value, float):
        return _fraction(value, device_bytes, key)
    if isinstance(value, str):
        text = value.strip()
        try:
            number: Any = float(text)
        except ValueError:
            return parse_capacity(text, key=key)
        if "." in text or "e" in text.lower():
            return _fraction(number, device_bytes, key)
        return parse_budget(int(number), device_bytes=device_bytes, key=key)
    raise ConfigError(f"{key}: got {value!r} of type {type(value).__name__}; {_ALLOWED}")


_ALLOWED = "allowed: a number of bytes, a size such as 40GiB, or a fraction of the device's memory in (0, 1]"


def _fraction(value: float, device_bytes: int | None, key: str) -> int:
    if not 0 < value <= 1:
        raise ConfigError(f"{key}: got {value}; a fraction of the device's memory must be in (0, 1]; {_ALLOWED}")
    if device_bytes is None:
        raise ConfigError(f"{key}: got the fraction {value}, but no device memory is known here (planning for the "
                          "CPU, or for a GPU this machine does not have); give bytes or a size such as 8GiB")
    return int(device_bytes * value)
