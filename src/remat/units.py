"""Sizes and operation counts as people read them: MiB below a GiB, GiB (TiB) with three significant digits above,
GFLOP below a TFLOP; never "0.06 GiB needs 0.06 GiB"."""

from __future__ import annotations

import re
from typing import Final

from remat.errors import ConfigError

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4


def format_bytes(num: float) -> str:
    """``num`` bytes with three significant digits in the largest unit that keeps it at least 1 (B, KiB, MiB, GiB,
    TiB): ``62.0 MiB``, ``1.50 GiB``, ``31.7 GiB``, ``128 GiB``."""
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(num) >= size:
            return f"{_three(num / size)} {unit}"
    return f"{int(num)} B"


def format_flops(num: float) -> str:
    """``num`` floating-point operations with three significant digits: GFLOP below a TFLOP, TFLOP above (PFLOP from
    a thousand TFLOP): ``42.1 GFLOP``, ``3.20 TFLOP``."""
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(num) >= size:
            return f"{_three(num / size)} {unit}"
    return f"{num:.3g} FLOP"


def _three(value: float) -> str:
    """Three significant digits, trailing zeros kept (``1.50``, ``31.7``, ``128``)."""
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


UNITS: Final[dict[str, int]] = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
"""Size units as written in ``--fits`` and budgets (matched case-insensitively): KB/MB/GB/TB are powers of 1000;
KiB/MiB/GiB/TiB and the bare K/M/G/T (as Slurm's ``--mem=80G`` and nvidia-smi write them) are powers of 1024."""
_UNIT_BY_LOWER: Final[dict[str, int]] = {name.lower(): size for name, size in UNITS.items()}
_CAPACITY = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]+)\s*$")


def parse_capacity(text: str, *, key: str = "--fits") -> int:
    """Bytes in a size such as ``"80GiB"``, ``"80G"``, ``"80 GB"`` or ``"24576MiB"`` (a unit is required; see `UNITS`:
    G and GiB are 2^30 bytes, GB is 10^9); ConfigError naming ``key`` otherwise. Light: no torch, so a command line
    is checked before anything heavy loads."""
    match = _CAPACITY.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNIT_BY_LOWER:
        raise ConfigError(f"{key}: got {text!r}; allowed: a number with a unit, one of {', '.join(UNITS)} "
                          "(case-insensitive; K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB of 1000; "
                          "e.g. 80GiB or 80G)")
    return int(float(match.group(1)) * _UNIT_BY_LOWER[unit])
