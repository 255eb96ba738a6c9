"""Replay a simulated step's allocations through an allocator model: peak, breakdown at the peak, and its phase.

Two choices a replay makes on top of the recorded order:

- ``kind``: ``"cuda"`` rounds and carves blocks like PyTorch's CUDA caching allocator
  (`remat.estimate.allocator.CachingAllocatorModel`); ``"exact"`` counts tensor bytes (the tracker's own figures).
- ``steady_state``: the optimizer's state is created during the first step but exists during every later one. With
  ``steady_state=True`` its allocations are moved to the start, before the forward pass, which is the memory of any
  step after the first (what ``torch.cuda.max_memory_allocated`` reports over a run).

The breakdown at the peak assigns each storage alive at the peak the category the tracker finally gave it (the
tracker decides "activations" when backward starts, "gradients" when they are accumulated, "optimizer_state" after
the step), like `LiveTensorTracker.peak_breakdown`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat.estimate.allocator import AllocatorKind, CachingAllocatorModel
from remat.estimate.simulate import GRADIENT_BUCKETS, LIBRARY_WORKSPACES, StorageEvent
from remat.memory.tracker import CATEGORIES

ESTIMATE_CATEGORIES: tuple[str, ...] = (*CATEGORIES, GRADIENT_BUCKETS, LIBRARY_WORKSPACES)
"""The tracker's categories plus DDP's gradient buckets and cuBLAS's workspaces (see `remat.estimate.simulate`)."""

START_PHASE = "start"
"""Phase of a peak reached before the first mark (the baseline: parameters, and state moved to the start)."""


@dataclass(frozen=True)
class ReplayResult:
    """The peak of one replay."""

    peak_bytes: int
    breakdown: dict[str, int]
    phase: str
    reserved_bytes: int
    phase_peaks: dict[str, int]
    """The highest allocated bytes within each phase (the first phase is `START_PHASE`)."""


def replay(
    events: Sequence[StorageEvent],
    marks: Sequence[tuple[int, str]],
    *,
    kind: AllocatorKind = "cuda",
    steady_state: bool = True,
) -> ReplayResult:
    """Replay ``events`` (with ``marks`` as (position, label)) and return the peak (see the module docstring)."""
    final_category: dict[int, str] = {}
    for event in events:
        if event.kind in ("alloc", "category"):
            final_category[event.serial] = event.category
    hoisted = {s for s, c in final_category.items() if c == "optimizer_state"} if steady_state else set()
    order, positions = _reorder(events, marks, hoisted)

    model = CachingAllocatorModel(kind)
    peak, peak_at = 0, 0
    phase_peaks: dict[str, int] = {START_PHASE: 0}
    phase, upcoming = START_PHASE, list(positions)
    for index, event in enumerate(order):
        while upcoming and upcoming[0][0] <= index:
            phase = upcoming.pop(0)[1]
            phase_peaks[phase] = max(phase_peaks.get(phase, 0), model.allocated)
        _apply(model, event)
        phase_peaks[phase] = max(phase_peaks[phase], model.allocated)
        if model.allocated > peak:
            peak, peak_at = model.allocated, index + 1
    reserved = model.peak_reserved

    model = CachingAllocatorModel(kind)
    for event in order[:peak_at]:
        _apply(model, event)
    live = _live_serials(order[:peak_at])
    breakdown = dict.fromkeys(ESTIMATE_CATEGORIES, 0)
    for serial in live:
        breakdown[final_category[serial]] += model.live_bytes(serial)
    return ReplayResult(peak_bytes=peak, breakdown=breakdown, phase=_phase_at(positions, peak_at),
                        reserved_bytes=reserved, phase_peaks=phase_peaks)


def _reorder(
    events: Sequence[StorageEvent], marks: Sequence[tuple[int, str]], hoisted: set[int]
) -> tuple[list[StorageEvent], list[tuple[int, str]]]:
    """Move the allocations of ``hoisted`` serials to the front; shift the mark positions accordingly."""
    if not hoisted:
        return list(events), list(marks)
    front = [e for e in events if e.kind == "alloc" and e.serial in hoisted]
    rest: list[StorageEvent] = []
    moved_before: list[int] = []  # moved_before[i]: hoisted allocations among events[:i]
    moved = 0
    for event in events:
        moved_before.append(moved)
        if event.kind == "alloc" and event.serial in hoisted:
            moved += 1
        else:
            rest.append(event)
    moved_before.append(moved)
    positions = [(len(front) + position - moved_before[position], label) for position, label in marks]
    return front + rest, positions


def _phase_at(positions: Sequence[tuple[int, str]], events_done: int) -> str:
    """The label of the last mark placed before the ``events_done``-th event."""
    phase = START_PHASE
    for position, label in positions:
        if position < events_done:
            phase = label
    return phase


def _apply(model: CachingAllocatorModel, event: StorageEvent) -> None:
    if event.kind == "alloc":
        model.malloc(event.serial, event.nbytes)
    elif event.kind == "free":
        model.free(event.serial)
    elif event.kind == "resize":
        model.resize(event.serial, event.nbytes)


def _live_serials(events: Sequence[StorageEvent]) -> set[int]:
    live: set[int] = set()
    for event in events:
        if event.kind == "alloc":
            live.add(event.serial)
        elif event.kind == "free":
            live.discard(event.serial)
    return live

