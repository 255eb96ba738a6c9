"""Presenting memory estimates: plain-text and rich tables, capacity parsing, and a PNG chart of the breakdowns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from remat.errors import ConfigError
from remat.units import UNITS, format_bytes, parse_capacity  # noqa: F401 (re-exported: the estimate's --fits)
from remat.estimate.replay import ESTIMATE_CATEGORIES

if TYPE_CHECKING:
    from remat.estimate.api import MemoryEstimate
    from remat.estimate.settings import StepSettings

GIB: Final[int] = 2**30
_COLORS: Final[dict[str, str]] = {
    "parameters": "#4C72B0", "buffers": "#8172B2", "gradients": "#DD8452", "optimizer_state": "#55A868",
    "activations": "#C44E52", "temporaries": "#937860", "gradient_buckets": "#DA8BC3",
    "library_workspaces": "#8C8C8C",
}


def gib(nbytes: int) -> str:
    """``nbytes`` in GiB with two decimals."""
    return f"{nbytes / GIB:.2f}"


@dataclass(frozen=True)
class _Unit:
    """The unit a table prints its sizes in: binary (GiB / MiB) and decimal (GB / MB)."""

    binary: str
    binary_bytes: int
    decimal: str
    decimal_bytes: float

    def in_binary(self, nbytes: int) -> str:
        return f"{nbytes / self.binary_bytes:.2f}"

    def in_decimal(self, nbytes: int) -> str:
        return f"{nbytes / self.decimal_bytes:.2f}"


_GIB_UNIT, _MIB_UNIT = _Unit("GiB", GIB, "GB", 1e9), _Unit("MiB", 2**20, "MB", 1e6)


def _unit(largest: int) -> _Unit:
    """GiB and GB when the largest figure is a GiB or more, MiB and MB below (a small step's figures would all read
    0.00 GiB)."""
    return _GIB_UNIT if largest >= GIB else _MIB_UNIT


def describe_settings(estimate: MemoryEstimate) -> str:
    """One line: model, shapes, precision, strategy and target of an estimate."""
    s = estimate.settings
    precision = s.dtype or "the model's dtype"
    if s.autocast:
        precision += f", autocast {s.autocast}"
    if s.mixed_precision:
        precision += f", FSDP compute in {s.mixed_precision}"
    parallel = describe_parallel(s)
    accumulation = f", {s.grad_accumulation} micro-batches per step" if s.grad_accumulation > 1 else ""
    lora = (f"; LoRA ({estimate.trainable_parameters:,} of {estimate.parameters:,} parameters trained)"
            if s.peft is not None else "")
    return (f"{estimate.model}; batch {s.batch_size} x {s.seq_length} tokens{accumulation}; {precision}; "
            f"optimizer {s.optimizer.rsplit('.', 1)[-1]}{lora}; {parallel}; modelled for {s.target.upper()}")


def breakdown_table(estimate: MemoryEstimate, *, capacity_bytes: int | None = None) -> str:
    """A plain-text report of one estimate: the breakdown at the peak and the other figures."""
    unit = _unit(estimate.peak_bytes)
    breakdown = {name: estimate.breakdown.get(name, 0) for name in ESTIMATE_CATEGORIES}
    rows = [(name, unit.in_binary(nbytes), unit.in_decimal(nbytes), _share(nbytes, estimate.peak_bytes))
            for name, nbytes in breakdown.items()]
    rows.append(("peak", unit.in_binary(estimate.peak_bytes), unit.in_decimal(estimate.peak_bytes), "100%"))
    lines = [f"{estimate.name}: {describe_settings(estimate)}",
             _columns(("at the peak", unit.binary, unit.decimal, "share"), rows),
             f"peak phase: {estimate.phase}",
             f"tensor bytes at the peak, without allocator rounding: {format_bytes(estimate.tensor_peak_bytes)}",
             f"first step (optimizer state created during it): {format_bytes(estimate.first_step_peak_bytes)}"]
    if estimate.reserved_bytes is not None:
        lines.append(f"reserved by the caching allocator (model): {format_bytes(estimate.reserved_bytes)}")
    if estimate.host_peak_bytes:
        lines.append(host_line(estimate))
    if capacity_bytes is not None:
        lines.append(f"fits {format_bytes(capacity_bytes)}: {'yes' if estimate.fits(capacity_bytes) else 'NO'}")
    lines.extend(f"note: {note}" for note in estimate.notes)
    return "\n".join(lines)


def _compare_header(unit: _Unit, capacity_bytes: int | None) -> tuple[str, ...]:
    return ("setting", f"peak {unit.binary}", f"peak {unit.decimal}", "params", "grads", "optim", "activ", "temps",
            "phase", *((f"fits {format_bytes(capacity_bytes)}",) if capacity_bytes is not None else ()))


def _compare_note(unit: _Unit) -> str:
    return (f"breakdown columns are {unit.binary} at the peak; params include buffers, grads include DDP buckets, "
            "temporaries cuBLAS workspaces")


def _compare_unit(estimates: Sequence[MemoryEstimate]) -> _Unit:
    return _unit(max((e.peak_bytes for e in estimates), default=0))


def _compare_rows(estimates: Sequence[MemoryEstimate], capacity_bytes: int | None) -> list[tuple[str, ...]]:
    unit = _compare_unit(estimates)
    rows = []
    for e in estimates:
        b = e.breakdown
        row = (e.name, unit.in_binary(e.peak_bytes), unit.in_decimal(e.peak_bytes),
               unit.in_binary(b["parameters"] + b["buffers"]), unit.in_binary(b["gradients"] + b["gradient_buckets"]),
               unit.in_binary(b["optimizer_state"]), unit.in_binary(b["activations"]),
               unit.in_binary(b["temporaries"] + b.get("library_workspaces", 0)), e.phase)
        if capacity_bytes is not None:
            row += ("yes" if e.fits(capacity_bytes) else "NO",)
        rows.append(row)
    return rows


def host_line(estimate: MemoryEstimate) -> str:
    """One line: the host memory an estimate's offloaded activations need at most (outside the device peak)."""
    return (f"host memory for offloaded activations, at most: {format_bytes(estimate.host_peak_bytes)} "
            "(per rank, not part of the peak)")


def comparison_table(estimates: Sequence[MemoryEstimate], *, capacity_bytes: int | None = None) -> str:
    """One row per estimate, side by side: the peak and its breakdown (GiB), its phase, and whether it fits."""
    unit = _compare_unit(estimates)
    table = _columns(_compare_header(unit, capacity_bytes), _compare_rows(estimates, capacity_bytes),
                     left=frozenset({0, 8}))
    lines = [describe_settings(estimates[0]) if estimates else "", table]
    lines.append(_compare_note(unit))
    lines.extend(f"{e.name}: {host_line(e)}" for e in estimates if e.host_peak_bytes)
    return "\n".join(lines)


def print_comparison(estimates: Sequence[MemoryEstimate], *, capacity_bytes: int | None = None,
                     rich: bool = False) -> None:
    """Print `comparison_table`, as a rich table when ``rich`` (an interactive terminal)."""
    if not rich:
        print(comparison_table(estimates, capacity_bytes=capacity_bytes))
        return
    from rich.console import Console
    from rich.table import Table

    unit = _compare_unit(estimates)
    header = _compare_header(unit, capacity_bytes)
    table = Table(title=describe_settings(estimates[0]) if estimates else None, title_justify="left")
    for index, name in enumerate(header):
        table.add_column(name, justify="left" if index in (0, 8) else "right")
    for row in _compare_rows(estimates, capacity_bytes):
        style = "red" if capacity_bytes is not None and row[-1] == "NO" else None
        table.add_row(*row, style=style)
    hosts = [f"{e.name}: {host_line(e)}" for e in estimates if e.host_peak_bytes]
    table.caption = "\n".join([_compare_note(unit), *hosts])
    Console().print(table)


def plot_breakdowns(estimates: Sequence[MemoryEstimate], path: str | Path, *,
                    capacity_bytes: int | None = None) -> Path:
    """Write a PNG with one stacked bar per estimate (its breakdown at the peak, in GiB or MiB); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not estimates:
        raise ConfigError("--plot: there is no estimate to plot")
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ConfigError(f"--plot: got {str(path)!r}; allowed: a path ending in .png")
    out.parent.mkdir(parents=True, exist_ok=True)
    names = [e.name for e in estimates]
    figure, axes = plt.subplots(figsize=(max(6.0, 1.3 * len(estimates) + 2.5), 4.8))
    bottoms = [0.0] * len(estimates)
    unit = _compare_unit(estimates)
    for category in ESTIMATE_CATEGORIES:
        values = [e.breakdown.get(category, 0) / unit.binary_bytes for e in estimates]
        if not any(values):
            continue
        axes.bar(names, values, bottom=bottoms, label=category.replace("_", " "), color=_COLORS[category])
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    for index, e in enumerate(estimates):
        axes.text(index, bottoms[index], unit.in_binary(e.peak_bytes), ha="center", va="bottom", fontsize=8)
    if capacity_bytes is not None:
        axes.axhline(capacity_bytes / unit.binary_bytes, color="black", linestyle="--", linewidth=1,
                     label=f"capacity {format_bytes(capacity_bytes)}")
    axes.set_ylabel(f"{unit.binary} at the peak")
    axes.set_title(f"Peak memory per setting ({estimates[0].settings.target.upper()} model)", fontsize=10)
    axes.tick_params(axis="x", labelrotation=30, labelsize=8)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _columns(header: Sequence[str], rows: Sequence[Sequence[str]], left: frozenset[int] = frozenset({0})) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def describe_parallel(s: StepSettings, *, shard: bool = True) -> str:
    """``single``, ``fsdp2 over 8 ranks``, or with context parallelism ``fsdp2 over 8 ranks (dp 1 x cp 8: one rank's
    peak, its 8192-token shard of each row)`` (``shard`` False leaves the shard's length out), with tensor
    parallelism ``fsdp2 over 8 ranks (dp 4 x tp 2: one rank's peak)``."""
    if s.strategy == "single":
        return "single"
    text = f"{s.strategy} over {s.world_size} ranks"
    if s.cp_size > 1 or s.tp_size > 1:
        layout = f"dp {s.data_parallel}" + (f" x cp {s.cp_size}" if s.cp_size > 1 else "") + (
            f" x tp {s.tp_size}" if s.tp_size > 1 else "")
        cut = f", its {-(-s.seq_length // s.cp_size)}-token shard of each row" if shard and s.cp_size > 1 else ""
        text += f" ({layout}: one rank's peak{cut})"
    return text
