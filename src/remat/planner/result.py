"""`ActivationPlan`: the planner's answer for one budget (per block: mode, offload, bytes kept and saved, FLOPs
recomputed), its predicted peak and recompute overhead, and the candidates it chose from.

`remat.apply_activation_checkpointing(model, plan)` accepts it (through ``plan.checkpoint_policy``), as does a
recipe's ``distributed.activation_checkpointing`` (``plan.policy.to_dict()``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from remat.checkpointing import CheckpointPolicy
from remat.checkpointing.policy import Mode
from remat.planner.timing import RecomputeRates
from remat.units import format_bytes, format_flops

GIB = 2**30


@dataclass(frozen=True)
class BlockChoice:
    """What the plan gives one block: ``mode`` (and ``offload``: what it keeps goes to host memory),
    ``kept_bytes`` it holds for backward per micro-batch (on the device, or in host memory when offloaded), ``saved_bytes`` less than without
    checkpointing, ``recompute_flops`` its backward recomputes per micro-batch."""

    index: int
    name: str
    kind: str
    mode: Mode
    kept_bytes: int
    saved_bytes: int
    recompute_flops: int
    offload: bool = False


@dataclass(frozen=True)
class Candidate:
    """One policy the planner priced: ``peak_bytes`` by the estimate, ``recompute_flops`` per optimizer step.
    ``uniform`` marks the one-mode-for-all policies (none / attention / mlp / selective / full / full every N, and
    their offloaded variants); ``transfer_bytes`` is what an offloading policy copies between host and device per
    optimizer step (out and back)."""

    label: str
    policy: CheckpointPolicy
    modes: tuple[Mode, ...]
    peak_bytes: int
    recompute_flops: int
    fits: bool
    uniform: bool
    transfer_bytes: int = 0
    recompute_cost: int = -1
    """The recompute's predicted time in FLOP-equivalents at the matmul rate (`remat.planner.timing`); its FLOPs
    when not given."""

    def __post_init__(self) -> None:
        if self.recompute_cost < 0:
            object.__setattr__(self, "recompute_cost", self.recompute_flops)

    def seconds(self, flops_per_second: float, host_bandwidth: float) -> float:
        """Predicted extra time per optimizer step: the recompute at ``flops_per_second`` (in FLOP-equivalents) plus
        the host<->device copies at ``host_bandwidth`` bytes/s (taken as not overlapping the compute)."""
        return self.recompute_cost / flops_per_second + self.transfer_bytes / host_bandwidth

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"label": self.label, "policy": self.policy.to_dict(), "modes": list(self.modes),
                "peak_bytes": self.peak_bytes, "peak_gib": round(self.peak_bytes / GIB, 3),
                "recompute_flops": self.recompute_flops, "recompute_cost": self.recompute_cost,
                "transfer_bytes": self.transfer_bytes, "fits": self.fits, "uniform": self.uniform}


@dataclass(frozen=True)
class ActivationPlan:
    """The least predicted recompute whose predicted whole-step peak fits ``budget_bytes`` (see `remat.planner`).

    ``peak_bytes`` is the estimate's figure for the chosen policy (``target="cuda"``: what
    ``torch.cuda.max_memory_allocated`` would report; ``"cpu"``: the tracked tensor peak). ``recompute_flops`` and
    ``step_flops`` are per optimizer step (all micro-batches); ``recompute_seconds`` prices the former at
    ``flops_per_second``.
    """

    policy: CheckpointPolicy
    budget_bytes: int
    peak_bytes: int
    recompute_flops: int
    step_flops: int
    flops_per_second: float
    target: str
    blocks: tuple[BlockChoice, ...]
    candidates: tuple[Candidate, ...] = ()
    notes: tuple[str, ...] = ()
    transfer_bytes: int = 0
    """Host<->device copies of the chosen policy per optimizer step (0 unless it offloads)."""
    host_bandwidth: float = 0.0
    """The host<->device bandwidth (bytes/s) ``transfer_seconds`` prices them at."""
    loss: str = ""
    """The loss the plan is for: ``plain`` / ``fused`` (chosen with ``activation_checkpointing.loss: choose``) or the
    recipe's ``loss_fn._target_``."""
    recompute_cost: int = -1
    """The recompute's predicted time in FLOP-equivalents at ``flops_per_second`` (`remat.planner.timing`); its
    FLOPs when not given, or when only one throughput is known."""
    rates: RecomputeRates | None = None
    """The per-class rates the recompute was priced at (a calibration's); None: FLOPs at ``flops_per_second``."""

    def __post_init__(self) -> None:
        if self.recompute_cost < 0:
            object.__setattr__(self, "recompute_cost", self.recompute_flops)

    @property
    def transfer_seconds(self) -> float:
        """Predicted time of the host<->device copies per optimizer step (0 without offload)."""
        return self.transfer_bytes / self.host_bandwidth if self.transfer_bytes else 0.0

    @property
    def checkpoint_policy(self) -> CheckpointPolicy:
        """The per-layer policy; what `apply_activation_checkpointing` applies when given the plan."""
        return self.policy

    @property
    def overhead(self) -> float:
        """Recomputed FLOPs as a share of the step's FLOPs without checkpointing (0.25: the step does 25% more)."""
        return self.recompute_flops / self.step_flops if self.step_flops else 0.0

    @property
    def recompute_seconds(self) -> float:
        """Predicted time of the recompute per optimizer step (at ``rates`` when given, else ``flops_per_second``)."""
        return self.recompute_cost / self.flops_per_second

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: budget, policy, predicted peak and recompute, per-block choices and the candidates."""
        return {
            "budget_bytes": self.budget_bytes,
            "budget_gib": round(self.budget_bytes / GIB, 3),
            "policy": self.policy.to_dict(),
            "describe": self.policy.describe(),
            "predicted_peak_bytes": self.peak_bytes,
            "predicted_peak_gib": round(self.peak_bytes / GIB, 3),
            "recompute_flops": self.recompute_flops,
            "step_flops": self.step_flops,
            "overhead": round(self.overhead, 4),
            "recompute_cost": self.recompute_cost,
            "recompute_seconds": self.recompute_seconds,
            "flops_per_second": self.flops_per_second,
            **({"rates_per_second": self.rates.to_dict()} if self.rates is not None else {}),
            "transfer_bytes": self.transfer_bytes,
            "transfer_seconds": self.transfer_seconds,
            "target": self.target,
            "loss": self.loss,
            "blocks": [asdict(block) for block in self.blocks],
            "candidates": [candidate.to_dict() for candidate in self.candidates],
            "notes": list(self.notes),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """``to_dict()`` as JSON."""
        return json.dumps(self.to_dict(), indent=indent)

    def summary(self) -> str:
        """One line: policy, predicted peak against the budget, and the recompute overhead."""
        transfers = (f"; host<->device copies {self.transfer_bytes / 1e9:.2f} GB (~{self.transfer_seconds:.3f} s at "
                     f"{self.host_bandwidth / 1e9:g} GB/s)" if self.transfer_bytes else "")
        return (f"{self.policy.describe()}: predicted peak {format_bytes(self.peak_bytes)} of "
                f"{format_bytes(self.budget_bytes)} budget; recompute {format_flops(self.recompute_flops)} "
                f"(+{100 * self.overhead:.1f}% of the step, ~{self.recompute_seconds:.3f} s at "
                f"{self.rates.describe() if self.rates is not None else f'{self.flops_per_second / 1e12:g} TFLOP/s'})"
                f"{transfers}")

    def table(self, *, candidates: bool = True) -> str:
        """The per-block choices (consecutive blocks with the same choice on one row), then, with ``candidates``,
        every candidate priced for this budget (the chosen one marked ``*``), as plain text."""
        lines = [self.summary(), *block_rows(self.blocks)]
        if candidates:
            lines += ["", "candidates (peak by the estimate, recompute per step):"]
            lines += candidate_rows(self.candidates, self.step_flops, chosen=self.policy,
                                    flops_per_second=self.flops_per_second)
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def block_rows(blocks: Sequence[BlockChoice]) -> list[str]:
    """A table of per-block choices; consecutive blocks of one kind with the same mode share a row."""
    runs: list[list[BlockChoice]] = []
    for block in blocks:
        if runs and (runs[-1][-1].kind, runs[-1][-1].mode, runs[-1][-1].offload) == (block.kind, block.mode,
                                                                                    block.offload):
            runs[-1].append(block)
        else:
            runs.append([block])
    rows = [("blocks", "kind", "mode", "offload", "kept MiB each", "saved MiB each", "recompute GFLOP each")]
    for run in runs:
        b = run[0]
        span = str(b.index) if len(run) == 1 else f"{b.index}-{run[-1].index}"
        rows.append((span, b.kind, b.mode, "yes" if b.offload else "-", f"{b.kept_bytes / 2**20:.1f}",
                     f"{b.saved_bytes / 2**20:.1f}", f"{b.recompute_flops / 1e9:.2f}"))
    return _columns(rows)


def candidate_rows(candidates: Sequence[Candidate], step_flops: int, *, chosen: CheckpointPolicy | None = None,
                   fits: bool = True, flops_per_second: float | None = None) -> list[str]:
    """A table of candidates ordered by predicted recompute time (FLOP-equivalents, `remat.planner.timing`); the
    ``chosen`` policy is marked ``*``; ``flops_per_second`` adds the predicted recompute seconds per step; ``fits``
    adds whether each fits the budget it was priced for."""
    timed = flops_per_second is not None
    rows = [("", "candidate", "policy", "peak", "recompute", "overhead", *(("recompute s",) if timed else ()),
             "fits")]
    for c in sorted(candidates, key=lambda c: (c.recompute_cost, c.recompute_flops, c.peak_bytes)):
        mark = "*" if chosen is not None and c.policy == chosen else ""
        overhead = f"+{100 * c.recompute_flops / step_flops:.1f}%" if step_flops else "-"
        seconds = (f"{c.recompute_cost / flops_per_second:.4g}",) if flops_per_second is not None else ()
        rows.append((mark, c.label, c.policy.describe(), format_bytes(c.peak_bytes),
                     format_flops(c.recompute_flops), overhead, *seconds, "yes" if c.fits else "no"))
    return _columns(rows if fits else [row[:-1] for row in rows])


def _columns(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
