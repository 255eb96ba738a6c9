"""The memory budget a plan must fit (`MemoryBudget`): bytes, a size (``"40GiB"``), a fraction of the device's
memory, or the default.

A budget is parsed once, where it is given (a recipe when it is validated, a keyword argument, ``--budget``), and
resolved to bytes only where the device is known: `MemoryBudget.resolve`. Without a budget on a GPU, the budget is
the device's total memory minus `DEFAULT_MARGIN` of it: the estimate predicts what ``torch.cuda.max_memory_allocated``
reports, and the allocator's reserved-but-unused blocks, the CUDA context and library workspaces live in that margin.
On the CPU there is no device total to start from, so a budget must be given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from remat.errors import ConfigError
from remat.units import parse_capacity

DEFAULT_MARGIN: Final[float] = 0.10
"""The share of a GPU's memory left out of the default budget (see the module docstring)."""

MIN_BUDGET: Final[int] = 2**20
"""Budgets below this (1 MiB) are taken for a forgotten unit."""
MAX_BUDGET: Final[int] = 2**60
"""The largest budget in bytes: 1 EiB, more than any machine holds (a larger integer is a typo, or overflows)."""

BudgetLike = int | float | str | None

_ALLOWED = "allowed: a number of bytes, a size such as 40GiB, or a fraction of the device's memory in (0, 1]"


@dataclass(frozen=True)
class MemoryBudget:
    """A parsed budget: ``size_bytes`` (an absolute size), or ``fraction`` of the device's memory, or neither (the
    default: the device's memory minus `DEFAULT_MARGIN`). Build one with `parse`."""

    size_bytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, value: BudgetLike | MemoryBudget, *, key: str = "memory_budget") -> MemoryBudget:
        """``value``: an integer number of bytes (at least `MIN_BUDGET`), a size with a unit (``"40GiB"``,
        ``"24GB"``), a fraction in (0, 1] (``0.8``, ``"0.8"``), or None for the default. `ConfigError` naming
        ``key`` for anything else (a negative size, text that is not a size, a boolean)."""
        if isinstance(value, MemoryBudget) or value is None:
            return value or cls()
        if isinstance(value, bool):
            raise ConfigError(f"{key}: got {value!r}; {_ALLOWED}")
        if isinstance(value, (int, float)) and value <= 0 or isinstance(value, str) and value.strip()[:1] == "-":
            raise ConfigError(f"{key}: got {value!r}; a budget is more than nothing; {_ALLOWED}")
        if isinstance(value, int):
            if value < MIN_BUDGET:
                raise ConfigError(f"{key}: got {value} bytes, less than 1 MiB; write a unit (e.g. {value}GiB); "
                                  f"{_ALLOWED}")
            if value > MAX_BUDGET:
                shown = f"{value}" if value < 10**30 else f"a {len(str(value))}-digit number of"
                raise ConfigError(f"{key}: got {shown} bytes, more than 1 EiB (2**60 bytes), more memory than any "
                                  f"machine has; {_ALLOWED}")
            return cls(size_bytes=value)
        if isinstance(value, float):
            if not 0 < value <= 1:
                raise ConfigError(f"{key}: got {value}; a fraction of the device's memory must be in (0, 1]; "
                                  f"{_ALLOWED}")
            return cls(fraction=value)
        if isinstance(value, str):
            text = value.strip()
            if text.isdigit():
                return cls.parse(int(text), key=key)
            try:
                number: Any = float(text)
            except ValueError:
                return cls(size_bytes=parse_capacity(text, key=key))
            return cls.parse(number, key=key)
        raise ConfigError(f"{key}: got {value!r} of type {type(value).__name__}; {_ALLOWED}")

    def resolve(self, device_bytes: int | None, *, key: str = "memory_budget") -> int:
        """The budget in bytes on a device of ``device_bytes`` (None: no device total is known, e.g. planning for
        the CPU, where a fraction or the default is a `ConfigError` naming ``key``)."""
        if self.size_bytes is not None:
            return self.size_bytes
        if device_bytes is None:
            if self.fraction is not None:
                raise ConfigError(f"{key}: got the fraction {self.fraction}, but no device memory is known here "
                                  "(planning for the CPU, or for a GPU this machine does not have); give bytes or a "
                                  "size such as 8GiB")
            raise ConfigError(f"{key}: required here: planning for the CPU, or for a GPU this machine does not have, "
                              "leaves no device memory to take a default from; give bytes or a size such as 8GiB")
        return int(device_bytes * (self.fraction if self.fraction is not None else 1 - DEFAULT_MARGIN))

    def to_value(self) -> int | float | None:
        """The value `parse` turns back into this budget (how a recipe saved with it spells it)."""
        return self.size_bytes if self.size_bytes is not None else self.fraction


def parse_budget(value: BudgetLike | MemoryBudget, *, device_bytes: int | None, key: str = "memory_budget") -> int:
    """The budget in bytes: `MemoryBudget.parse` then `MemoryBudget.resolve` (see them); `ConfigError` naming
    ``key``."""
    return MemoryBudget.parse(value, key=key).resolve(device_bytes, key=key)
