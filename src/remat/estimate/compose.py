"""Compose the allocation trace of a per-block policy from simulated steps that gave each block the same treatment.

The planner prices many policies for one step, most of them per-block mixes of a few modes (``full`` on blocks 0-7,
``attention`` on 8, ``none`` on the rest). Simulating each one repeats the same work: a block given ``full`` allocates
the same tensors, in the same order, whatever its neighbours got. `compose` therefore builds a mix's trace from
traces already simulated with ``blocks=True`` (`remat.estimate.simulate.simulate_step`): block ``i``'s forward and
backward segments come from a trace whose block ``i`` had the same layout, everything else (the embedding, the loss,
the optimizer step) from the first trace. The result is the event sequence the simulation of the mix would record,
serials renamed, so its replay (peak, phase peaks, breakdown) is the simulation's to the byte: the suite checks that
against real simulations (tests/estimate/test_compose.py).

# NOTE [ Which tensor is which across traces, and when it dies ]
# A segment refers to tensors allocated in other segments: the next block frees this block's output, a block's
# backward gathers the previous block's parameters early (FSDP2) and frees its reduce-scatter buffer, the optimizer
# step frees every gradient. When the two segments come from different traces, the tensor must be found in the
# trace that supplied its allocation: outside the blocks allocations match one for one (the same code ran); within
# a block, the allocations used outside it (its *interface*) are matched in order, and both lists must have the
# same sizes.
# A tensor dies when its last holder lets go, and the holders can sit in different traces: a bfloat16 block output
# is held by the decoder's loop until the next block returns and, under ``full``, by the next block until its
# backward. A free recorded in a segment is a release by that segment's code, so the composed free is the latest of
# the frees the chosen segments recorded, provided no trace in use released the tensor later in a segment it does
# not supply while one of its own segments in between could have held it (a release the composition cannot see). A
# block can hold only what it allocated or was given (its recorded inputs), unless its model shares keys and values
# between blocks. Anything else that does not line up (a free of a dead tensor, a different
# number of live tensors at the end) means the traces do not compose: `compose` returns None and the caller
# simulates. Backward's first op re-files the live forward temporaries as activations (`LiveTensorTracker`); the
# composition re-files by the tracker's own rule at the recorded phase switch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from remat.estimate.simulate import BLOCK_BACKWARD, BLOCK_FORWARD, BlockLayout, StepTrace, StorageEvent
from remat.recipes.step import UPDATE_PHASE

_REFILED = "activations"  # the category backward's first op moves forward temporaries to
_TEMPORARIES = "temporaries"
_NEVER = 1 << 62  # the segment index of "never freed"


@dataclass
class _Segment:
    label: str
    block: int | None
    events: list[StorageEvent]


@dataclass
class ParsedTrace:
    """One trace cut at its boundaries, with where each storage was allocated, freed and used."""

    trace: StepTrace
    segments: list[_Segment]
    keys: list[tuple[str, int]]
    origin: dict[int, tuple[int, int]] = field(default_factory=dict)
    """serial -> (segment index, allocation index within the segment)."""
    freed_in: dict[int, int] = field(default_factory=dict)
    """serial -> the segment that freed it."""
    users: dict[int, set[int]] = field(default_factory=dict)
    """serial -> the segments whose events (re-filing aside) refer to it."""
    _interfaces: dict[int, list[int]] = field(default_factory=dict)

    def group(self, segment: int) -> int | None:
        """The block a segment belongs to (None: outside the blocks)."""
        return self.segments[segment].block

    def allocs(self, segment: int) -> list[StorageEvent]:
        return [e for e in self.segments[segment].events if e.kind == "alloc"]

    @functools.cached_property
    def update(self) -> int:
        """The index of the segment where the optimizer update starts (the end of a partial trace)."""
        return next((i for i, key in enumerate(self.keys) if key[0] == UPDATE_PHASE), len(self.segments))

    def interface(self, segment: int) -> list[int]:
        """Allocation indices of a block's ``segment`` whose storages are used outside the block before the update,
        or live when it starts (the update frees the gradients), in order: the same list in a whole and a partial
        trace."""
        if segment not in self._interfaces:
            own, update = self.group(segment), self.update
            self._interfaces[segment] = [
                j for j, event in enumerate(self.allocs(segment))
                if self.freed_in.get(event.serial, _NEVER) >= update
                or any(u < update and self.group(u) != own for u in self.users.get(event.serial, ()))]
        return self._interfaces[segment]

    def signature(self, segment: int) -> list[int]:
        """A block segment's interface as bytes: equal signatures match in order (who frees what is settled by
        the release rule, see the NOTE above)."""
        allocs = self.allocs(segment)
        return [allocs[j].nbytes for j in self.interface(segment)]


def parse(trace: StepTrace) -> ParsedTrace | None:
    """``trace`` cut into segments (None when it was not recorded with block boundaries)."""
    if not trace.layers:
        return None
    bounds = [(0, "start"), *trace.boundaries]
    segments, keys, seen = [], [], {}
    for index, (position, label) in enumerate(bounds):
        end = bounds[index + 1][0] if index + 1 < len(bounds) else len(trace.events)
        block = None
        for prefix in (BLOCK_FORWARD, BLOCK_BACKWARD):
            if label.startswith(prefix):
                block = int(label[len(prefix):])
        segments.append(_Segment(label, block, trace.events[position:end]))
        seen[label] = seen.get(label, 0) + 1
        keys.append((label, seen[label]))
    parsed = ParsedTrace(trace, segments, keys)
    for index, segment in enumerate(segments):
        allocs = 0
        for event in segment.events:
            if event.kind == "alloc":
                parsed.origin[event.serial] = (index, allocs)
                allocs += 1
            elif event.kind != "phase" and not (event.kind == "category" and event.category == _REFILED):
                parsed.users.setdefault(event.serial, set()).add(index)
                if event.kind == "free":
                    parsed.freed_in[event.serial] = index
    return parsed


class _CannotCompose(Exception):
    """The traces do not line up; the caller simulates instead."""


def compose(target: Sequence[BlockLayout], traces: Sequence[ParsedTrace]) -> StepTrace | None:
    """The trace of the step whose block ``i`` has layout ``target[i]``, built from ``traces`` (the first, a whole
    step, supplies everything outside the blocks; the others may stop where the update starts), or None when some
    block's layout is in none of them or they do not line up."""
    start = time.perf_counter()
    reference = traces[0]
    if len(target) != len(reference.trace.layers):
        return None
    if reference.trace.partial:
        return None
    chosen: list[ParsedTrace] = []
    for index, layout in enumerate(target):
        source = next((t for t in traces if t.trace.layers[index] == layout), None)
        # a partial trace (stopped where the update starts) has the reference's segments up to there
        if source is None or source.keys != reference.keys[:len(source.keys)]:
            return None
        chosen.append(source)
    try:
        events, marks = _Composer(reference, chosen).run()
    except _CannotCompose:
        return None
    ref = reference.trace
    composed = StepTrace(ref.recipe, ref.run, events=events, marks=marks, host_peak=0, parameters=ref.parameters,
                         trainable_parameters=ref.trainable_parameters,
                         notes=[n for n in ref.notes if not n.startswith("activation checkpointing:")])
    composed.layers = tuple(target)
    composed.seconds = time.perf_counter() - start
    return composed


Storage = tuple[int, int]  # (segment, allocation index in the trace that supplies the segment)


class _Composer:
    def __init__(self, reference: ParsedTrace, chosen: list[ParsedTrace]) -> None:
        self.reference = reference
        self.owner = [chosen[s.block] if s.block is not None else reference for s in reference.segments]
        self.sources = list({id(o): o for o in self.owner}.values())
        self.checked: set[tuple[int, int]] = set()
        search = reference.trace.blocks
        self.shares_state = search is None or any(block.kv_sharing for block in search.blocks)

    def storage(self, source: ParsedTrace, serial: int) -> Storage | None:
        """Which storage of the composed step ``serial`` of ``source`` is (None: one internal to a block that
        another trace supplies, which the composed step does not have)."""
        if serial not in source.origin:
            raise _CannotCompose
        segment, alloc = source.origin[serial]
        owner = self.owner[segment]
        if owner is source:
            return segment, alloc
        if (id(source), segment) not in self.checked:
            if source.group(segment) is None:
                same = [e.nbytes for e in source.allocs(segment)] == [e.nbytes for e in owner.allocs(segment)]
            else:
                same = source.signature(segment) == owner.signature(segment)
            if not same:
                raise _CannotCompose
            self.checked.add((id(source), segment))
        if source.group(segment) is None:
            return segment, alloc
        interface = source.interface(segment)
        if alloc not in interface:
            return None
        return segment, owner.interface(segment)[interface.index(alloc)]

    def run(self) -> tuple[list[StorageEvent], list[tuple[int, str]]]:
        # pass 1: the chosen segments' events, storages named by where the composed step allocates them
        steps: list[tuple[StorageEvent, Storage | None]] = []
        segment_at: list[int] = []
        marks_at: list[tuple[int, str]] = []
        present: dict[Storage, list[int]] = {}
        phases = {label for _, label in self.reference.trace.marks}
        for index, segment in enumerate(self.reference.segments):
            if index and segment.label in phases:
                marks_at.append((len(steps), segment.label))
            source = self.owner[index]
            allocs = 0
            for event in source.segments[index].events:
                if event.kind == "category" and event.category == _REFILED:
                    continue  # re-filed again below, by the tracker's rule
                if event.kind == "alloc":
                    name: Storage | None = (index, allocs)
                    allocs += 1
                elif event.kind == "phase":
                    name = None
                else:
                    name = self.storage(source, event.serial)
                    if name is None:
                        raise _CannotCompose
                    if event.kind == "free":
                        present.setdefault(name, []).append(len(steps))
                steps.append((event, name))
                segment_at.append(index)
        last_free = self._last_frees(present, segment_at)
        return self._emit(steps, last_free, marks_at)

    def _last_frees(self, present: dict[Storage, list[int]], segment_at: list[int]) -> dict[Storage, int]:
        """Where each storage dies in the composed step (see the NOTE above)."""
        released: dict[Storage, list[tuple[ParsedTrace, int]]] = {}
        for source in self.sources:
            for serial, (segment, _alloc) in source.origin.items():
                name = self.storage(source, serial)
                if name is not None:
                    released.setdefault(name, []).append((source, serial, source.freed_in.get(serial, _NEVER)))
        last: dict[Storage, int] = {}
        for name, releases in released.items():
            frees = present.get(name, [])
            end = segment_at[frees[-1]] if frees else -1
            for source, serial, segment in releases:
                if segment != _NEVER and self.owner[segment] is source:
                    continue  # recorded in the composed step
                if segment == _NEVER and end == -1:
                    continue  # held to the end here and never freed in the composed step either
                # a release in a segment this trace does not supply: the composed step differs only if a holder this
                # trace supplies lets go later than the recorded free, in one of its segments up to that point
                upto = len(self.owner) - 1 if segment == _NEVER else segment
                holders = self._holders(source, serial)
                if any(self.owner[z] is source and (holders is None or source.group(z) in holders)
                       for z in range(end + 1, upto + 1)):
                    raise _CannotCompose
            if frees:
                last[name] = frees[-1]
        return last

    def _holders(self, source: ParsedTrace, serial: int) -> set[int | None] | None:
        """The groups that can hold storage ``serial`` of ``source``: the code outside the blocks, the block that
        allocated it and the blocks it was given to (None, anyone: blocks that share keys and values hand tensors
        to later blocks outside their arguments)."""
        if self.shares_state:
            return None
        allocated = source.group(source.origin[serial][0])
        return {None, allocated, *(block for block, inputs in source.trace.block_inputs.items() if serial in inputs)}

    def _emit(self, steps: list[tuple[StorageEvent, Storage | None]], last_free: dict[Storage, int],
              marks_at: list[tuple[int, str]]) -> tuple[list[StorageEvent], list[tuple[int, str]]]:
        out: list[StorageEvent] = []
        serials: dict[Storage, int] = {}
        live: dict[int, list[Any]] = {}  # serial -> [bytes, category], in order of allocation
        forward_start = 0
        marks = []
        pending = list(marks_at)
        for position, (event, name) in enumerate(steps):
            while pending and pending[0][0] == position:
                marks.append((len(out), pending.pop(0)[1]))
            if event.kind == "phase":
                out.append(event)
                if event.category == "forward":
                    forward_start = len(serials)
                else:
                    for serial, state in live.items():
                        if state[1] == _TEMPORARIES and serial >= forward_start:
                            state[1] = _REFILED
                            out.append(StorageEvent("category", serial, state[0], _REFILED))
                continue
            assert name is not None
            if event.kind == "alloc":
                serial = len(serials)
                serials[name] = serial
                live[serial] = [event.nbytes, event.category]
                out.append(StorageEvent("alloc", serial, event.nbytes, event.category))
                continue
            serial = serials.get(name, -1)
            if serial not in live:
                raise _CannotCompose
            if event.kind == "free":
                if last_free.get(name) != position:
                    continue  # an earlier holder let go; the storage lives on
                del live[serial]
            elif event.kind == "resize":
                live[serial][0] = event.nbytes
            elif event.kind == "category":
                live[serial][1] = event.category
            out.append(StorageEvent(event.kind, serial, event.nbytes, event.category))
        marks.extend((len(out), label) for _, label in pending)
        if len(live) != _live_at_end(self.reference.trace):
            raise _CannotCompose
        return out, marks


def _live_at_end(trace: StepTrace) -> int:
    live: set[int] = set()
    for event in trace.events:
        if event.kind == "alloc":
            live.add(event.serial)
        elif event.kind == "free":
            live.discard(event.serial)
    return len(live)
