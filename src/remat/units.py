"""Sizes and operation counts as people read them: MiB below a GiB, GiB (TiB) with three significant digits above,
GFLOP below a TFLOP; never "0.06 GiB needs 0.06 GiB"."""

from __future__ import annotations

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
