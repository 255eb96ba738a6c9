"""Presenting the answers of `remat.estimate.longest.find_longest`: one row per setting, with how each was found."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from remat.estimate.report import _columns, describe_parallel, gib
from remat.units import format_bytes

if TYPE_CHECKING:
    from remat.estimate.longest import LongestAnswer

_HEADER = ("setting", "longest tokens", "peak GiB", "KiB/token", "fixed GiB", "phase", "how")


def _tokens(answer: LongestAnswer) -> str:
    if answer.seq_length is None:
        return "-"
    text = f"{answer.seq_length:,}"
    return text + " (limit)" if answer.at_limit else text


def longest_table(answers: Sequence[LongestAnswer], *, model: str = "") -> str:
    """A plain-text table: the longest fitting sequence of each setting, the peak there, the memory per further
    token and what does not grow with the sequence (from the binding phase's line), and how it was found; then the
    reasons and notes under it."""
    rows = []
    for a in answers:
        per_token = a.bytes_per_token
        fixed = a.fixed_bytes
        rows.append((
            a.label, _tokens(a),
            gib(a.predicted_peak_bytes) if a.predicted_peak_bytes is not None else "-",
            f"{per_token / 1024:.1f}" if per_token is not None else "-",
            gib(int(fixed)) if fixed is not None else "-",
            a.binding_phase or "-", a.method,
        ))
    lines = []
    if answers:
        s = answers[0].settings
        precision = f"{s.dtype}" + (f", autocast {s.autocast}" if s.autocast else "")
        lines.append(f"longest sequence whose predicted peak fits {format_bytes(answers[0].capacity_bytes)}: "
                     f"{model + '; ' if model else ''}batch {s.batch_size}; {precision}; "
                     f"optimizer {s.optimizer.rsplit('.', 1)[-1]}; {describe_parallel(s, shard=False)}; modelled for "
                     f"{s.target.upper()}")
    lines.append(_columns(_HEADER, rows, left=frozenset({0, 5, 6})))
    lines.append("extrapolated: from three estimates at shorter lengths (per phase, peak = fixed + per token x "
                 "length); confirmed: a direct estimate at the answer fits and one granularity step more does not")
    for a in answers:
        if a.reason:
            lines.append(f"{a.label}: {a.method}: {a.reason}")
        for note in a.notes:
            lines.append(f"{a.label}: {note}")
    return "\n".join(lines)
