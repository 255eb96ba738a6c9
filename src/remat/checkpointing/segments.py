"""Segments: consecutive blocks recomputed in backward as one unit, keeping only the segment's input.

A model's own loop calls its blocks one at a time (``for layer in self.layers: h = layer(h, mask=..., ...)``), and
the arguments may differ per block (sliding/global masks, per-layer inputs). So a segment cannot be run by its first
block. Instead each block of a segment records its call as it happens and runs under saved-tensor hooks that keep
nothing: every tensor autograd would save becomes a ticket. The first ticket unpacked in backward replays the
segment's recorded calls (each with its own RNG and autocast state, each block's input being the replayed output of
the block before it) and fills in every ticket of the segment; backward then frees them as it goes. This is what
non-reentrant ``torch.utils.checkpoint`` does for one call, stretched over several calls, with public autograd
hooks only. Code the model runs *between* blocks is outside the hooks and saves what it saves as usual.

Memory: a segment keeps its first block's input (and the arguments shared by all blocks, such as masks) until
backward; during backward of a segment its blocks' activations are live together. Compute: one extra forward of
every block, as with full checkpointing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from remat.checkpointing.wrappers import Runner, WrapKind
from remat.errors import CheckpointingError


class Segment:
    """Blocks ``first``..``last`` (their positions 0..size-1 in the segment) recomputed together.

    Holds the run of the forward pass in progress between the calls of its blocks, and nothing once the last
    block of the segment has run (the run then lives in the autograd graph until backward frees it).
    """

    def __init__(self, first: int, last: int, names: tuple[str, ...]) -> None:
        self.first = first
        self.last = last
        self.names = names
        self._open: _SegmentRun | None = None

    @property
    def size(self) -> int:
        """How many blocks the segment has."""
        return self.last - self.first + 1

    def member(self, position: int) -> SegmentMember:
        """The runner for the block at ``position`` (0-based) in this segment."""
        if not 0 <= position < self.size:
            raise ValueError(f"position {position} is outside a segment of {self.size} blocks")
        return SegmentMember(self, position)

    def run_call(
        self, position: int, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run one block's call as part of the current run (a new run starts at position 0, or when the calls
        do not follow the segment's order, e.g. a layer skipped by layer-drop)."""
        run = self._open
        if run is None or position == 0 or run.next_position != position:
            run = _SegmentRun(self, position)
            self._open = run
        try:
            out = run.call(position, inner, args, kwargs)
        except BaseException:
            self._open = None
            raise
        if position == self.size - 1:
            self._open = None
        return out


class SegmentMember(Runner):
    """The runner of one block of a `Segment`."""

    kind: WrapKind = "segment"
    recomputes = True

    def __init__(self, segment: Segment, position: int) -> None:
        self.segment = segment
        self.position = position

    def __call__(
        self, module: nn.Module, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        return self.segment.run_call(self.position, inner, args, kwargs)


# --- one forward pass through a segment ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Chained:
    """Stands for an input that was output ``leaf`` of recorded call ``call``: replayed, not kept."""

    call: int
    leaf: int


@dataclass(frozen=True, eq=False)
class _Ticket:
    """What autograd holds instead of a saved tensor: which call saved it, and its rank among that call's saves."""

    run: _SegmentRun
    call: int
    index: int


@dataclass
class _Call:
    inner: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: _RngState
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    saved: list[tuple[torch.Size, torch.dtype, torch.device]]


class _SegmentRun:
    def __init__(self, segment: Segment, start: int) -> None:
        self.segment = segment
        self.start = start
        self.calls: list[_Call] = []
        self.outputs: list[list[weakref.ref[torch.Tensor]]] = []
        self.recomputed: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def next_position(self) -> int:
        return self.start + len(self.calls)

    def call(self, position: int, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        index = len(self.calls)
        record = _Call(
            inner=inner,
            args=tuple(self._link(a) for a in args),
            kwargs={k: self._link(v) for k, v in kwargs.items()},
            rng=_RngState.capture(args, kwargs),
            autocast=_autocast_state(),
            saved=[],
        )
        self.calls.append(record)

        def pack(tensor: torch.Tensor) -> _Ticket:
            record.saved.append((tensor.shape, tensor.dtype, tensor.device))
            return _Ticket(self, index, len(record.saved) - 1)

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = inner(*args, **kwargs)
        self.outputs.append([weakref.ref(t) for t in _tensor_leaves(out)])
        return out

    def _link(self, value: Any) -> Any:
        """An input that is an output of an earlier call of this run becomes a `_Chained` (not kept alive)."""
        if not isinstance(value, torch.Tensor):
            return value
        for call in range(len(self.outputs) - 1, -1, -1):
            for leaf, ref in enumerate(self.outputs[call]):
                if ref() is value:
                    return _Chained(call, leaf)
        return value

    def take(self, ticket: _Ticket) -> torch.Tensor:
        key = (ticket.call, ticket.index)
        if key not in self.recomputed:  # first unpack of this backward (or a later backward with retain_graph)
            self._recompute()
        return self.recomputed.pop(key)

    def _recompute(self) -> None:
        outputs: list[list[torch.Tensor]] = []
        recomputed: dict[tuple[int, int], torch.Tensor] = {}
        last = len(self.calls) - 1
        with torch.enable_grad(), _forked_rng(self.calls):
            for index, call in enumerate(self.calls):
                args = tuple(_resolve(a, outputs) for a in call.args)
                kwargs = {k: _resolve(v, outputs) for k, v in call.kwargs.items()}
                saved: list[torch.Tensor] = []
                # The last block's output is not needed: stop as soon as it has saved all it saved in the forward
                # (like torch's early stop), which skips its final ops (e.g. the MLP's down projection).
                stop_at = len(call.saved) if index == last else None

                def pack(tensor: torch.Tensor, saved: list[torch.Tensor] = saved, stop_at: int | None = stop_at) -> Any:
                    # Detached: a saved output holding its own grad_fn would make a reference cycle that keeps the
                    # whole replay alive until the garbage collector runs.
                    detached = tensor.detach() if tensor.requires_grad else tensor
                    saved.append(detached)
                    if len(saved) == stop_at:
                        raise _ReplayDone
                    return detached

                _check_gathered(call.inner, self.segment)
                call.rng.restore()
                out = None
                if stop_at != 0:
                    try:
                        with ExitStack() as stack:
                            for device_type, enabled, dtype in call.autocast:
                                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
                            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
                            out = call.inner(*args, **kwargs)
                    except _ReplayDone:
                        pass
                self._check(index, call, saved)
                recomputed.update(((index, n), t) for n, t in enumerate(saved))
                outputs.append(_tensor_leaves(out))
        self.recomputed = recomputed

    def _check(self, index: int, call: _Call, saved: list[torch.Tensor]) -> None:
        got = [(t.shape, t.dtype, t.device) for t in saved]
        if got == call.saved:
            return
        block = self.segment.names[self.start + index - self.segment.first] if self.segment.names else str(index)
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(call.saved, got)) if a != b), min(len(got), len(call.saved))
        )
        raise CheckpointingError(
            f"segment {self.segment.first}-{self.segment.last}: replaying block {block} saved {len(got)} tensors, "
            f"the forward saved {len(call.saved)} (first difference at tensor {first_diff}); the block does not "
            "compute the same thing twice from the same inputs (data-dependent control flow or state changed "
            "between forward and backward). Use full or every_n_layers for this model instead of segments"
        )


def _check_gathered(inner: Callable[..., Any], segment: Segment) -> None:
    """Refuse to replay a block whose parameters are sharded (FSDP2 resharded it after its forward)."""
    module = getattr(inner, "__self__", None)
    if not isinstance(module, nn.Module) or not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in module.parameters()):
        raise CheckpointingError(
            f"segment {segment.first}-{segment.last}: the parameters of {type(module).__name__} are sharded when "
            "the segment is replayed in backward. Shard each segment as one unit (fully_shard(list of the "
            "segment's blocks) for each group of CheckpointPlan.shard_groups()), or use full / every_n_layers"
        )


class _ReplayDone(Exception):
    """Raised from the replay's pack hook once the last block has saved everything backward needs."""


def _unpack(ticket: _Ticket) -> torch.Tensor:
    return ticket.run.take(ticket)


def _resolve(value: Any, outputs: list[list[torch.Tensor]]) -> Any:
    return outputs[value.call][value.leaf] if isinstance(value, _Chained) else value


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in a block's output, in a stable order (tensor, or nested tuples / lists / dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensor_leaves(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensor_leaves(item)]
    return []


# --- RNG and autocast state, per call -------------------------------------------------------------------------


@dataclass
class _RngState:
    cpu: torch.Tensor
    device_type: str | None
    devices: list[int]
    device_states: list[torch.Tensor]

    @classmethod
    def capture(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _RngState:
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        device_type = next((t.device.type for t in tensors if t.device.type not in ("cpu", "meta")), None)
        devices: list[int] = []
        states: list[torch.Tensor] = []
        if device_type is not None:
            devices, states = get_device_states(*tensors)
        return cls(torch.get_rng_state(), device_type, devices, states)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device_type is not None:
            set_device_states(self.devices, self.device_states, device_type=self.device_type)


def _forked_rng(calls: list[_Call]) -> Any:
    """Put the global RNG state back after the replay, as if it never happened."""
    device_type = next((c.rng.device_type for c in calls if c.rng.device_type is not None), None)
    devices = sorted({d for c in calls for d in c.rng.devices})
    if device_type is None:
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=devices, device_type=device_type)


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    """Autocast (enabled, dtype) for the CPU and the available accelerator, to replay under the same settings."""
    device_types = ["cpu"]
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None:
        device_types.append(accelerator.type)
    return tuple(
        (dt, torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) for dt in device_types
    )

