"""Choosing a mode per block: the frontier of (bytes saved, recompute cost) over all per-block assignments, and
the policy that spells one assignment. The cost is the recompute's predicted time in FLOP-equivalents
(`remat.planner.timing.RecomputeRates.cost`; its FLOPs when only one throughput is known).

Blocks of one kind cost the same, so an assignment is, per kind, how many blocks get each mode. `frontier` keeps
only the Pareto-optimal ones (no other saves as much for less cost), built block by block with dominated partial
assignments dropped at each step (a multiple-choice knapsack solved exactly over the frontier). `assign` places the
modes: within a kind, the modes that keep the least go to the earliest blocks, whose saved activations live
longest (until the end of backward), and the recompute of the last blocks, done first in backward while nearly
everything is still held, is avoided.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from remat.checkpointing import CheckpointPolicy
from remat.checkpointing.policy import LayerOverride
from remat.checkpointing.policy import Mode
from remat.planner.measure import BlockKind, BlockMeasurements, ModeCost


@dataclass(frozen=True)
class Assignment:
    """How many blocks of each kind get each mode (``counts[k][i]`` for ``kinds[k].costs[i]``), what that saves
    against keeping everything, and what its recompute costs (per micro-batch, FLOP-equivalents)."""

    counts: tuple[tuple[int, ...], ...]
    saved_bytes: int
    cost: int


CostOf = Callable[[ModeCost], int]
"""A mode's recompute cost on one block (`remat.planner.timing.RecomputeRates.cost_of`)."""


def recompute_flops(cost: ModeCost) -> int:
    """The cost of FLOPs alone (one throughput for every op)."""
    return cost.recompute_flops


def frontier(measurements: BlockMeasurements, cost_of: CostOf = recompute_flops) -> list[Assignment]:
    """Every Pareto-optimal assignment, ordered by bytes saved (the first saves nothing and recomputes nothing)."""
    combined = [Assignment((), 0, 0)]
    for kind in measurements.kinds:
        per_kind = _kind_frontier(kind, cost_of)
        combined = _pareto([
            Assignment((*a.counts, b.counts[0]), a.saved_bytes + b.saved_bytes, a.cost + b.cost)
            for a in combined for b in per_kind
        ])
    return combined


def cheapest_saving(options: Sequence[Assignment], needed_bytes: int) -> Assignment | None:
    """The assignment that saves at least ``needed_bytes`` at the least cost; None when none saves enough."""
    enough = [a for a in options if a.saved_bytes >= needed_bytes]
    return min(enough, key=lambda a: (a.cost, -a.saved_bytes)) if enough else None


def assign(assignment: Assignment, measurements: BlockMeasurements) -> tuple[Mode, ...]:
    """The mode of every block (see the module docstring for the placement)."""
    modes: list[Mode] = ["none"] * measurements.num_blocks
    for kind, counts in zip(measurements.kinds, assignment.counts, strict=True):
        order = sorted(range(len(kind.costs)), key=lambda i: kind.costs[i].kept_bytes)
        placed = [kind.costs[i].mode for i in order for _ in range(counts[i])]
        for index, mode in zip(kind.indices, placed, strict=True):
            modes[index] = mode
    return tuple(modes)


def uniform(measurements: BlockMeasurements, mode: Mode, every: int = 1) -> tuple[Mode, ...]:
    """``mode`` on blocks 0, ``every``, 2 x ``every``, ...; blocks that cannot take it (no such sub-module) keep
    everything."""
    modes: list[Mode] = []
    for index in range(measurements.num_blocks):
        kind = measurements.kind_of(index)
        takes = any(cost.mode == mode for cost in kind.costs)
        modes.append(mode if takes and index % every == 0 else "none")
    return tuple(modes)


def totals(modes: Sequence[Mode], measurements: BlockMeasurements) -> tuple[int, int]:
    """(bytes saved against keeping everything, FLOPs recomputed) of per-block ``modes``, per micro-batch."""
    saved = flops = 0
    for index, mode in enumerate(modes):
        kind = measurements.kind_of(index)
        cost = kind.cost(mode)
        saved += kind.cost("none").kept_bytes - cost.kept_bytes
        flops += cost.recompute_flops
    return saved, flops


def total_cost(modes: Sequence[Mode], measurements: BlockMeasurements, cost_of: CostOf = recompute_flops) -> int:
    """The recompute cost of per-block ``modes``, per micro-batch."""
    return sum(cost_of(measurements.kind_of(index).cost(mode)) for index, mode in enumerate(modes))


def policy_of(modes: Sequence[Mode]) -> CheckpointPolicy:
    """The shortest `CheckpointPolicy` that gives block ``i`` the mode ``modes[i]``: one mode for all, else the most
    common mode with per-layer exceptions in ranges."""
    if not modes:
        return CheckpointPolicy(mode="none")
    base = max(dict.fromkeys(modes), key=modes.count)
    overrides = []
    start = 0
    for index in range(1, len(modes) + 1):
        if index == len(modes) or modes[index] != modes[start]:
            if modes[start] != base:
                overrides.append(LayerOverride(start, index - 1, modes[start]))
            start = index
    return CheckpointPolicy(mode=base, layers=tuple(overrides))


def _kind_frontier(kind: BlockKind, cost_of: CostOf) -> list[Assignment]:
    """Pareto-optimal count vectors for the blocks of one kind (an assignment over this kind alone)."""
    none = kind.cost("none").kept_bytes
    options = [(none - cost.kept_bytes, cost_of(cost)) for cost in kind.costs]
    states = [Assignment(((0,) * len(options),), 0, 0)]
    for _ in kind.indices:
        grown = []
        for state in states:
            for i, (saved, flops) in enumerate(options):
                counts = list(state.counts[0])
                counts[i] += 1
                grown.append(Assignment((tuple(counts),), state.saved_bytes + saved, state.cost + flops))
        states = _pareto(grown)
    return states


def _pareto(options: list[Assignment]) -> list[Assignment]:
    """The options no other beats (saves at least as much for at most the cost), ordered by bytes saved."""
    best: dict[tuple[tuple[int, ...], ...], Assignment] = {a.counts: a for a in options}
    ordered = sorted(best.values(), key=lambda a: (-a.saved_bytes, a.cost))
    kept: list[Assignment] = []
    for option in ordered:
        if not kept or option.cost < kept[-1].cost:
            kept.append(option)
    return kept[::-1]
