"""Selective (op-level) activation checkpointing: which op outputs a checkpointed block keeps, and a trace of it.

Inside a block wrapped by non-reentrant ``torch.utils.checkpoint.checkpoint``, every ATen op's output is either
saved during the forward pass (backward reads it from a cache) or recomputed when backward needs it. This module
decides per op call:

- ``SAVE``: the expensive results listed in :data:`SAVE_OPS` (attention kernels, MoE routing), every collective
  (namespaces in :data:`SAVE_OP_NAMESPACES`), and :data:`DEVICE_TO_HOST_OPS` when they really read an accelerator
  tensor back to the host;
- ``ALTERNATE``: the matmuls in :data:`ALTERNATE_OPS`; every other one is saved (the 1st, 3rd, ... of a region);
- ``RECOMPUTE``: everything else (element-wise ops, norms, views, softmax, ...), and every op that draws random
  numbers even if a table lists it (see :func:`draws_random_numbers`).

An op that writes into one of its inputs (``add_``, ``out=`` variants, in-place collectives) is never saved: its
cached result would stand in for the call during recompute, and the write into the recomputed input would be lost.

A saved output that the forward later mutates in place is not kept either (see :func:`mutation_safe_contexts`):
the cache would hand the mutated values to backward. Mixtral normalises its router's ``topk`` values in place, and
gemma3n's AltUp adds into a ``bmm`` output through ``torch.matmul``'s ``_unsafe_view`` (a view with its own version
counter, so torch's own check never sees the write). Such an entry is downgraded to recompute when the checkpointed
forward exits, or before recompute when the write came after the region.

Use it as ``checkpoint(fn, *args, use_reentrant=False, context_fn=selective_context_fn())``. With ``trace=True`` or
``REMAT_SELECTIVE_AC_TRACE=1`` each unique (op, decision) pair is logged once per process on the
``remat.checkpointing.selective`` logger at INFO, and so is each unique downgrade; :func:`selective_trace_summary`
returns what was seen.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy as TorchCheckpointPolicy  # torch's enum, not remat's policy
from torch.utils.checkpoint import SelectiveCheckpointContext

from remat.checkpointing._mutation_guard import (
    POLICY_SEES_OUTPUT,
    ContextPair,
    PolicyFn,
    guarded_contexts,
    schema_written,
)
from remat.errors import ConfigError

__all__ = [
    "ALTERNATE_OPS",
    "DEVICE_TO_HOST_OPS",
    "POLICY_SEES_OUTPUT",
    "SAVE_OPS",
    "SAVE_OP_NAMESPACES",
    "TRACE_ENV_VAR",
    "Decision",
    "SelectivePolicy",
    "TraceRecord",
    "draws_random_numbers",
    "mutation_safe_contexts",
    "reset_selective_trace",
    "selective_context_fn",
    "selective_trace_enabled",
    "selective_trace_summary",
]

logger = logging.getLogger("remat.checkpointing.selective")

TRACE_ENV_VAR = "REMAT_SELECTIVE_AC_TRACE"

_ATTENTION = "attention kernel: O(seq^2) FLOPs for an O(seq*dim) output"

SAVE_OPS: Mapping[str, str] = {
    "aten._scaled_dot_product_flash_attention.default": _ATTENTION + " (SDPA, CUDA flash)",
    "aten._scaled_dot_product_flash_attention_for_cpu.default": _ATTENTION + " (SDPA on the CPU)",
    "aten._scaled_dot_product_efficient_attention.default": _ATTENTION + " (SDPA, memory-efficient)",
    "aten._scaled_dot_product_cudnn_attention.default": _ATTENTION + " (SDPA, cuDNN)",
    "aten._scaled_dot_product_fused_attention_overrideable.default": _ATTENTION + " (SDPA, out-of-tree backends)",
    "aten._flash_attention_forward.default": _ATTENTION + " (flash kernel called directly)",
    "aten._efficient_attention_forward.default": _ATTENTION + " (memory-efficient kernel called directly)",
    "higher_order.flex_attention": _ATTENTION + " (FlexAttention, compiled)",
    "aten.topk.default": "MoE router: a recomputed router could pick other experts (non-deterministic kernels), "
    "so routing is saved to be identical on recompute",
}
"""Ops whose outputs are always saved, by op name, with the reason."""

ALTERNATE_OPS: Mapping[str, str] = {
    "aten.mm.default": "dense matmul (linear layers)",
    "aten.addmm.default": "dense matmul with bias (linear layers with bias, GPT-2 Conv1D)",
    "aten.bmm.default": "batched matmul (eager attention scores and values)",
    "aten.baddbmm.default": "batched matmul with bias (eager attention with additive masks)",
    "aten._grouped_mm.default": "grouped matmul (MoE experts)",
    "aten._scaled_mm.default": "fp8 matmul (float8 linear layers)",
}
"""Matmuls: every other call in a checkpointed region is saved. Saving all of them would keep nearly as much as no
checkpointing (each output is a full per-token activation); saving none would recompute every GEMM. Alternating
halves both the bytes kept and the GEMM FLOPs recomputed."""

SAVE_OP_NAMESPACES: Mapping[str, str] = {
    "_c10d_functional": "collective: recomputing would communicate again, and every rank would have to recompute "
    "in lockstep or deadlock",
    "_c10d_functional_autograd": "collective with autograd support (expert-parallel all-to-all)",
    "c10d_functional": "collective (legacy functional collectives)",
}
"""Op namespaces whose ops are always saved, with the reason."""

DEVICE_TO_HOST_OPS: Mapping[str, str] = {
    "aten._to_copy.default": "copy to the host: a transfer and a device synchronisation",
    "aten._local_scalar_dense.default": "`.item()`: reads a value back to the host, a device synchronisation",
    "aten.nonzero.default": "data-dependent output size, read back to the host: a device synchronisation",
}
"""Ops saved only when an input lives on an accelerator and the result is on (or is read back to) the host; on the
CPU they are ordinary cheap ops and are recomputed."""

_RANDOM_REASON = "draws random numbers: recomputed so the RNG stream replays draw for draw"
_DEFAULT_REASON = "cheap to recompute (element-wise, normalisation, view, reduction, ...)"
_IN_PLACE_REASON = (
    "writes into an input: a cached result would replace the call in recompute and the write would be lost, so it "
    "is recomputed (an in-place collective communicates again in backward, on every rank alike)"
)


class Decision(str, Enum):
    """How the policy treats an op: always saved, every other call saved (matmuls), or recomputed."""

    SAVE = "SAVE"
    ALTERNATE = "ALTERNATE"
    RECOMPUTE = "RECOMPUTE"


@dataclasses.dataclass
class TraceRecord:
    """One unique (op, decision) pair seen by a traced policy in this process.

    ``shapes``/``dtypes``/``nbytes`` describe the tensor outputs of the first call; ``calls`` counts every forward
    call since the last reset and ``saved`` how many of those outputs were kept (for ``ALTERNATE`` about half);
    ``downgraded`` how many of the saved ones were dropped again because the forward (or the code after the region)
    wrote into them in place, and are recomputed in backward instead (see :func:`mutation_safe_contexts`).
    """

    decision: Decision
    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    nbytes: int
    reason: str
    calls: int = 0
    saved: int = 0
    downgraded: int = 0

    def format(self) -> str:
        """The trace line, e.g. ``ALTERNATE aten.mm.default  out [4, 512] float32 8.0 KiB  (dense matmul ...)``.

        The reason is appended for every decision except the default recompute of cheap ops.
        """
        if self.shapes:
            outs = ", ".join(f"{list(s)} {d}" for s, d in zip(self.shapes, self.dtypes, strict=True))
        else:
            outs = "no tensor"
        line = f"{self.decision.value:<9} {self.op}  out {outs} {_format_bytes(self.nbytes)}"
        return line if self.reason == _DEFAULT_REASON else f"{line}  ({self.reason})"


_trace_lock = threading.Lock()
_trace_records: dict[tuple[str, Decision], TraceRecord] = {}


def selective_trace_summary() -> list[TraceRecord]:
    """Copies of the trace records seen in this process since the last reset, in first-seen order."""
    with _trace_lock:
        return [dataclasses.replace(r) for r in _trace_records.values()]


def reset_selective_trace() -> None:
    """Forget every traced op and downgrade, so the next traced run logs each unique one again and counts from zero."""
    with _trace_lock:
        _trace_records.clear()
        _downgrades_logged.clear()


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def selective_trace_enabled() -> bool:
    """Whether ``REMAT_SELECTIVE_AC_TRACE`` asks for the trace; a value that is not a boolean is a ConfigError."""
    raw = os.environ.get(TRACE_ENV_VAR, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(
        f"environment variable {TRACE_ENV_VAR}={raw!r} is not understood; allowed: 1/true/yes/on or 0/false/no/off"
    )


def _op_name(op: Any) -> str:
    return str(op)


def _op_namespace(op: Any) -> str:
    return str(getattr(op, "namespace", ""))


def draws_random_numbers(op: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether this call consumes the RNG (dropout, ``bernoulli_``, attention with ``dropout_p > 0``, ...).

    Such a call is never cached: checkpoint restores the RNG state before recompute, and recompute reproduces the
    forward's random numbers only if it makes exactly the same draws in the same order. Skipping one cached random
    op would shift the generator for every random op after it and silently change their dropout masks. Attention
    kernels carry the ``nondeterministic_seeded`` tag whatever their ``dropout_p``, so that argument decides.
    """
    return _draws(_info(op), args, kwargs)


def _draws(info: _OpInfo, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    if not info.seeded:
        return False
    if info.dropout is None:
        return True
    position, default = info.dropout
    value = kwargs["dropout_p"] if "dropout_p" in kwargs else args[position] if position < len(args) else default
    return bool(value) and float(value) > 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class _OpInfo:
    """What the policy needs to know of an op, read from its schema once per process: one dictionary
    lookup per call instead of one per question (an ``OpOverload``'s hash is a Python method, and selective
    checkpointing asks for every op of every checkpointed forward)."""

    op: Any  # held, so that its id (the cache key) is never reused by another object
    name: str
    rule: tuple[Decision | None, str]
    seeded: bool  # tagged nondeterministic_seeded: may draw random numbers
    dropout: tuple[int, Any] | None  # (position, default) of its dropout_p argument, when it has one


_op_infos: dict[int, _OpInfo] = {}  # keyed by id(op): an int hashes in C, an OpOverload in Python


def _info(op: Any) -> _OpInfo:
    info = _op_infos.get(id(op))
    if info is None:
        schema = getattr(op, "_schema", None)
        dropout = None
        if schema is not None:
            dropout = next(((i, a.default_value) for i, a in enumerate(schema.arguments) if a.name == "dropout_p"),
                           None)
        info = _op_infos[id(op)] = _OpInfo(
            op=op,
            name=_op_name(op),
            rule=_static_rule(op),
            seeded=torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()),
            dropout=dropout,
        )
    return info


def _on_accelerator(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta") for t in tree_leaves(value))


def _moves_to_host(op_name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any) -> bool:
    """Whether the call reads an accelerator tensor back to the host. ``out`` is None where torch asks the policy
    before the op runs (torch 2.11); ``_to_copy``'s destination is then its ``device`` argument."""
    if not _on_accelerator(args):
        return False
    if op_name == "aten._to_copy.default":
        if isinstance(out, torch.Tensor):
            return out.device.type == "cpu"
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu"
    return True  # .item() and nonzero read a result back to the host whatever the output device


def _table_rule(op: Any) -> tuple[Decision | None, str]:
    name = _op_name(op)
    if name in SAVE_OPS:
        return Decision.SAVE, SAVE_OPS[name]
    if name in ALTERNATE_OPS:
        return Decision.ALTERNATE, ALTERNATE_OPS[name]
    namespace = _op_namespace(op)
    if namespace in SAVE_OP_NAMESPACES:
        return Decision.SAVE, SAVE_OP_NAMESPACES[namespace]
    if name in DEVICE_TO_HOST_OPS:
        return None, DEVICE_TO_HOST_OPS[name]
    return Decision.RECOMPUTE, _DEFAULT_REASON


def _static_rule(op: Any) -> tuple[Decision | None, str]:
    """The table decision for an op (None: depends on the devices of the call), and its reason.

    An op that writes into an input is recomputed whatever the tables say (see :data:`_IN_PLACE_REASON`).
    """
    decision, reason = _table_rule(op)
    if decision is not Decision.RECOMPUTE and schema_written(getattr(op, "_schema", None)):
        return Decision.RECOMPUTE, f"{_IN_PLACE_REASON} (otherwise: {reason})"
    return decision, reason


class SelectivePolicy:
    """The policy function of one checkpointed region (one ``checkpoint`` call): decides SAVE or RECOMPUTE per op.

    Called by torch as ``policy(ctx, op, *args, **kwargs)``: after the op ran (``ctx.op_output`` holds its output)
    on torch 2.13+, before it runs on torch 2.11, where the trace line of a call waits for :meth:`output_seen`. With ``save_every_other_mm=False`` every matmul is saved instead of every other one.
    """

    def __init__(self, *, save_every_other_mm: bool = True, trace: bool = False) -> None:
        self.save_every_other_mm = save_every_other_mm
        self.trace = trace
        # Matmul calls seen so far, counted separately for the forward pass and for recompute. Torch versions that
        # call the policy during recompute too (is_recompute=True) must get the same answer for the n-th matmul of
        # the recompute as for the n-th of the forward: that answer says whether backward finds the output in the
        # cache or recomputes it. One shared counter would continue from the forward's total, flip the parity when
        # a region has an odd number of matmuls, and look up outputs that were never cached. Torch 2.13 replays the
        # forward's decisions from its cache by index and calls the policy in the forward only; the per-mode count
        # keeps this policy correct under both behaviours.
        self._matmul_calls: dict[bool, int] = {False: 0, True: 0}
        self._unrecorded: tuple[Any, Decision, bool, str] | None = None

    def decide(
        self, op: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any, *, is_recompute: bool = False
    ) -> tuple[Decision, bool, str]:
        """(decision, whether this call's output is saved, reason) for one op call; advances the matmul count."""
        info = _info(op)
        if _draws(info, args, kwargs):
            return Decision.RECOMPUTE, False, _RANDOM_REASON
        decision, reason = info.rule
        if decision is None:  # a device-to-host candidate: saved only when it really leaves the accelerator
            decision = Decision.SAVE if _moves_to_host(info.name, args, kwargs, out) else Decision.RECOMPUTE
            if decision is Decision.RECOMPUTE:
                reason = "stays on the host: " + _DEFAULT_REASON
        if decision is Decision.ALTERNATE:
            index = self._matmul_calls[is_recompute]
            self._matmul_calls[is_recompute] = index + 1
            if not self.save_every_other_mm:
                return Decision.SAVE, True, reason
            return Decision.ALTERNATE, index % 2 == 0, reason
        return decision, decision is Decision.SAVE, reason

    def __call__(self, ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> TorchCheckpointPolicy:
        sees_output = hasattr(ctx, "op_output")
        out = ctx.op_output if sees_output else None
        decision, save, reason = self.decide(op, args, kwargs, out, is_recompute=ctx.is_recompute)
        if self.trace and not ctx.is_recompute:
            if sees_output:
                _record(op, decision, save, reason, out)
            else:
                self._unrecorded = (op, decision, save, reason)
        return TorchCheckpointPolicy.MUST_SAVE if save else TorchCheckpointPolicy.PREFER_RECOMPUTE


    def output_seen(self, out: Any) -> None:
        """The output of the call just decided, where torch asked before the op ran: records its trace line."""
        if self._unrecorded is not None:
            op, decision, save, reason = self._unrecorded
            self._unrecorded = None
            _record(op, decision, save, reason, out)


def _record(op: Any, decision: Decision, saved: bool, reason: str, out: Any) -> None:
    name = _op_name(op)
    with _trace_lock:
        record = _trace_records.get((name, decision))
        if record is None:
            tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            record = TraceRecord(
                decision=decision,
                op=name,
                shapes=tuple(tuple(int(d) for d in t.shape) for t in tensors),
                dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
                nbytes=sum(t.numel() * t.element_size() for t in tensors),
                reason=reason,
            )
            _trace_records[(name, decision)] = record
            logger.info("%s", record.format())
        record.calls += 1
        record.saved += int(saved)


def _format_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024.0 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024.0
    raise AssertionError("unreachable")


def mutation_safe_contexts(
    policy_fn: PolicyFn, *, trace: bool = False, observe_outputs: bool | None = None
) -> ContextPair:
    """``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy_fn)``, except that backward never gets a
    cached output that was written in place after it was cached: such an entry is recomputed instead (the guard is
    `remat.checkpointing._mutation_guard.guarded_contexts`, NOTE [ Cached outputs mutated in place ] there).

    ``policy_fn(ctx, op, *args, **kwargs)`` is any torch selective-checkpoint policy. On top of it, an op that writes
    into one of its inputs is never cached, and every entry whose storage is written after it was cached is
    downgraded to recompute: at the exit of the checkpointed forward or, for writes after the region, right before
    recompute. ``trace=True`` logs each unique downgrade on the ``remat.checkpointing.selective`` logger; a
    collective's downgraded output is said once at WARNING (recomputing it communicates again). ``observe_outputs``
    (default: when torch does not pass ``ctx.op_output``) sees the outputs through a dispatch mode of its own.
    """
    return guarded_contexts(policy_fn, report=functools.partial(_report_downgrade, trace=trace),
                            observe_outputs=observe_outputs)


def _report_downgrade(op: Any, cause: str, *, trace: bool) -> None:
    name = _op_name(op)
    if trace:
        _record_downgrade(name, cause)
    if _op_namespace(op) in SAVE_OP_NAMESPACES:
        _warn_once(
            ("collective", name),
            "selective checkpointing: the output of collective %s was written in place after it was saved (%s); "
            "it is recomputed in backward, which communicates again (every rank runs the same code, so every "
            "rank does it)",
            name,
            cause,
        )


_warned: set[Any] = set()


def _warn_once(key: Any, message: str, *args: Any) -> None:
    with _trace_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message, *args)


_downgrades_logged: set[tuple[str, str]] = set()


def _record_downgrade(name: str, cause: str) -> None:
    with _trace_lock:
        for record in _trace_records.values():
            if record.op == name and record.decision is not Decision.RECOMPUTE:
                record.downgraded += 1
                break
        first = (name, cause) not in _downgrades_logged
        _downgrades_logged.add((name, cause))
    if first:
        logger.info(
            "DOWNGRADE %s  saved output later written in place (%s): recomputed in backward instead", name, cause
        )



def selective_context_fn(
    *, trace: bool | None = None, save_every_other_mm: bool = True
) -> Callable[[], ContextPair]:
    """A ``context_fn`` for non-reentrant ``torch.utils.checkpoint.checkpoint`` that applies :class:`SelectivePolicy`.

    Each call of the returned function (torch makes one per ``checkpoint`` call) builds a fresh policy, so the
    matmul alternation starts over in every checkpointed region. ``trace=None`` reads ``REMAT_SELECTIVE_AC_TRACE``
    at each region; ``True``/``False`` force it.
    """
    if trace is not None and not isinstance(trace, bool):
        raise ConfigError(f"selective_context_fn(trace=...) got {trace!r}; allowed: True, False or None (use env)")
    if not isinstance(save_every_other_mm, bool):
        raise ConfigError(
            f"selective_context_fn(save_every_other_mm=...) got {save_every_other_mm!r}; allowed: True or False"
        )

    def context_fn() -> ContextPair:
        traced = selective_trace_enabled() if trace is None else trace
        policy = SelectivePolicy(save_every_other_mm=save_every_other_mm, trace=traced)
        return mutation_safe_contexts(policy, trace=traced)

    return context_fn
