"""The guard under remat's selective checkpointing (private): torch's selective-checkpoint contexts, except that a
cached output written in place after it was cached is recomputed instead of handed to backward mutated.

It works on torch internals that have no public API (its caching mode's storage, through
`remat.checkpointing.sac_layout`, and the version counters of the cached tensors), so it lives apart from the op
tables of `remat.checkpointing.selective`, which uses it through `guarded_contexts`.
"""

from __future__ import annotations

import inspect
import weakref
from collections import defaultdict
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy as TorchCheckpointPolicy  # torch's enum, not remat's policy
from torch.utils.checkpoint import SelectiveCheckpointContext, create_selective_checkpoint_contexts

from remat.checkpointing.sac_layout import CachedEntry, SacLayout, sac_layout

ContextPair = tuple[AbstractContextManager[Any], AbstractContextManager[Any]]
PolicyFn = Callable[..., "TorchCheckpointPolicy | bool"]
#: Told of each cached entry the guard downgrades to recompute: ``report(op, cause)``.
Downgraded = Callable[[Any, str], None]


@dataclass(frozen=True, slots=True)
class _OpFacts:
    """What the guard needs of an op, read from its schema once per process (keyed by ``id(op)``: an int hashes in
    C, an ``OpOverload`` in Python, and the guard asks for every op of every checkpointed forward)."""

    op: Any  # held, so that its id is never reused by another object
    name: str
    written: tuple[tuple[int, str], ...]  # (position, name) of each argument the op writes into
    returns_alias: bool  # an output declared as an alias of an input (views, in-place ops)


_op_facts: dict[int, _OpFacts] = {}


def _facts(op: Any) -> _OpFacts:
    facts = _op_facts.get(id(op))
    if facts is None:
        schema = getattr(op, "_schema", None)
        facts = _op_facts[id(op)] = _OpFacts(
            op=op, name=str(op), written=schema_written(schema),
            returns_alias=schema is None or any(r.alias_info is not None for r in schema.returns))
    return facts


# NOTE [ Cached outputs mutated in place ]
# Torch's selective checkpointing stores, per (op, call index), either "recompute" or the detached output, and
# recompute replays those entries by index without looking at the policy again. An output that the forward mutates in
# place after it was stored would be handed to backward mutated. Torch catches that only when the write bumps the
# output's own version counter (then it raises); a write through an alias with its own counter goes unseen. The
# common case is ``torch.matmul`` on operands of more than two dimensions: it runs ``bmm`` and returns
# ``_unsafe_view(bmm_out)``, which shares the storage but not the version counter, so gemma3n's AltUp
# (``predictions = torch.matmul(...); predictions += hidden_states``) corrupted the cached bmm output silently.
#
# guarded_contexts therefore follows the storages of the outputs it saves: every op the policy sees whose
# schema writes into an argument (``Tensor(a!)``) marks the storage it writes into, every non-view output that
# shares a saved storage (``_unsafe_view``) is remembered with its version, and when the checkpointed forward exits
# each saved entry whose storage was written, or whose version moved, is dropped from torch's cache (through the
# per-version adapter in sac_layout.py), so recompute re-runs that call.
# Right before recompute the same check runs again for writes made after the region (through the output or such an
# alias). Recomputing an entry is exact: recompute re-runs every call that is not served from the cache, so the op's
# inputs are recomputed to their forward values (or served from entries that are themselves clean), and random ops
# are never cached. Writes the dispatcher never sees (through ``.data`` made outside the region, or by kernels
# launched outside torch's dispatcher) cannot be followed; torch's own version check still raises on the rest.


def schema_written(schema: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument an op's schema writes into (``Tensor(a!)``); () without a schema."""
    return () if schema is None else tuple(
        (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def _storage_ids(value: Any) -> set[int]:
    """Identities of the storages behind the tensors in ``value`` (for wrapper subclasses such as DTensor, of their
    inner tensors). A tensor whose storage cannot be read (functional tensors while tracing) is left out."""
    ids: set[int] = set()
    if type(value) is torch.Tensor:  # the common case, without the pytree walk
        _add_storage_ids(value, ids)
        return ids
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            _add_storage_ids(leaf, ids)
    return ids


def _add_storage_ids(tensor: torch.Tensor, ids: set[int]) -> None:
    if type(tensor) is not torch.Tensor and is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            _add_storage_ids(getattr(tensor, name), ids)
        return
    try:
        ids.add(tensor.untyped_storage()._cdata)
    except Exception:  # noqa: BLE001 - no storage to follow (fake/functional tensors, sparse); the version check stays
        pass


def _argument(args: tuple[Any, ...], kwargs: Mapping[str, Any], position: int, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[position] if position < len(args) else None


_AFTER_REGION = "after the checkpointed region, before backward"
_UNSEEN_WRITE = "in the forward, by a write the policy did not see (the version counter moved)"


class _MutationGuard:
    """Follows the saved outputs of one checkpointed region and the in-place writes into their storages, and takes
    the entries written into back out of torch's cache (through :func:`~remat.checkpointing.sac_layout.sac_layout`)."""

    def __init__(self, layout: SacLayout, report: Downgraded) -> None:
        self.layout = layout
        self.report = report
        self.saved: dict[int, str] = {}  # storage id -> first op whose saved output lives there (forward only)
        self.written: dict[int, str] = {}  # saved storage id -> how it was written into afterwards
        # Outputs sharing a saved storage without sharing its version counter: (weak reference, version seen).
        self.aliases: dict[int, list[tuple[weakref.ref[torch.Tensor], int]]] = defaultdict(list)
        # From the exit of the forward to recompute: (storage id, detached alias, version at the exit). A detached
        # tensor shares the alias's version counter and storage (kept alive by the cache entry anyway) and has no
        # autograd graph, so holding it costs no memory and makes no reference cycle; the alias's Python object
        # itself may be gone by backward (the caller dropped it) while writes through it were still possible.
        self.watched: list[tuple[int, torch.Tensor, int]] = []
        # Per op, whether each forward call was cached: replayed to torch versions that ask the policy again in the
        # recompute, with the dropped entries turned to "recompute" (see sac_layout.QueueLayout).
        self.forward_saved: dict[Any, list[bool]] = defaultdict(list)
        self.recompute_calls: dict[Any, int] = defaultdict(int)
        # Set by the policy while an op runs under the observer: whether torch caches this call (None: torch did
        # not ask the policy, e.g. for detach, and caches nothing).
        self.pending: bool | None = None

    def replayed(self, op: Any) -> TorchCheckpointPolicy:
        """The forward's decision for the next recompute call of ``op`` (recompute when the entry was dropped)."""
        index = self.recompute_calls[op]
        self.recompute_calls[op] = index + 1
        calls = self.forward_saved.get(op, ())
        saved = index < len(calls) and calls[index]
        return TorchCheckpointPolicy.MUST_SAVE if saved else TorchCheckpointPolicy.PREFER_RECOMPUTE

    def observe(self, op: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any, saved: bool) -> None:
        """One forward call, seen by the policy after it ran and before torch stores its entry."""
        if self.saved:
            info = _facts(op)
            if info.written:
                for position, name in info.written:
                    for sid in _storage_ids(_argument(args, kwargs, position, name)):
                        if sid in self.saved:
                            self.written.setdefault(sid, f"by {info.name} in the forward")
            elif not saved and not info.returns_alias:
                for leaf in (out,) if type(out) is torch.Tensor else tree_leaves(out):
                    if isinstance(leaf, torch.Tensor):
                        for sid in _storage_ids(leaf):
                            if sid in self.saved:
                                self.aliases[sid].append((weakref.ref(leaf), leaf._version))
        if saved:
            name = _facts(op).name
            for sid in _storage_ids(out):
                self.saved.setdefault(sid, name)

    def after_forward(self, storage: dict[Any, dict[int, Any]]) -> None:
        """Downgrade the entries written during the forward; watch the aliases that could still be written."""
        dirty = dict(self.written)
        for sid, refs in self.aliases.items():
            for ref, version in refs:
                tensor = ref()
                if tensor is not None and tensor._version != version:
                    dirty.setdefault(sid, _UNSEEN_WRITE)
        kept = self._downgrade(storage, dirty, _UNSEEN_WRITE)
        with torch.no_grad():
            self.watched = [
                (sid, tensor.detach(), tensor._version)
                for sid, refs in self.aliases.items()
                if sid in kept
                for tensor in (ref() for ref, _ in refs)
                if tensor is not None
            ]
        self.saved.clear()
        self.written.clear()
        self.aliases.clear()

    def before_recompute(self, storage: dict[Any, dict[int, Any]]) -> None:
        """Downgrade the entries written after the region (through the output itself or a watched alias)."""
        dirty = {sid: _AFTER_REGION for sid, tensor, version in self.watched if tensor._version != version}
        self.watched = []
        self._downgrade(storage, dirty, _AFTER_REGION)

    def _downgrade(self, storage: dict[Any, Any], dirty: Mapping[int, str], moved: str) -> set[int]:
        """Drop every cached entry whose storage is dirty or whose version moved (recompute re-runs those calls);
        returns the storage ids of the entries still cached."""
        kept: set[int] = set()
        dropped: list[tuple[CachedEntry, str]] = []
        follow = bool(dirty) or bool(self.aliases)  # storage ids are needed only to match writes or aliases
        for entry in self.layout.cached(storage, self.forward_saved):
            ids: set[int] = set()
            if follow:
                vals = [w.val for w in entry.wrappers]
                ids = _storage_ids(vals[0] if len(vals) == 1 else vals)
            cause = next((dirty[sid] for sid in ids if sid in dirty), None)
            if cause is None and any(w.val._version != w.version for w in entry.wrappers):
                cause = moved
            if cause is None:
                kept |= ids
            else:
                dropped.append((entry, cause))
        if dropped:
            self.layout.drop(storage, self.forward_saved, [entry for entry, _ in dropped])
        for entry, cause in dropped:
            key = entry.key
            self.report(key[0] if isinstance(key, tuple) else key, cause)
        return kept


class _OutputObserver(TorchDispatchMode):
    """Shows the guard each op's output, on torch versions whose policy runs before the op (no ``ctx.op_output``).

    Pushed above torch's caching mode, so it sees the call first and its result last: the policy, asked by torch's
    mode in between, leaves its decision in ``guard.pending``. Higher-order ops (FlexAttention, compiled regions) are
    passed through to torch's mode, which has rules for them.
    """

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, guard: _MutationGuard, output_seen: Callable[[Any], None] | None) -> None:
        super().__init__()
        self.guard = guard
        self.output_seen = output_seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = {} if kwargs is None else kwargs
        self.guard.pending = None
        out = func(*args, **kwargs)
        saved, self.guard.pending = self.guard.pending, None
        if saved is not None:
            if self.output_seen is not None:
                self.output_seen(out)
            self.guard.observe(func, args, kwargs, out, saved)
        return out


class _GuardedMode(TorchDispatchMode):
    """Stands for one of torch's two selective-checkpoint modes (it is entered and left in its place: torch's own
    mode is pushed, so higher-order ops that look their mode up by exact type still find it) and runs the guard when
    the forward exits or before the recompute starts. A TorchDispatchMode itself because torch.compile requires
    ``context_fn`` to return two of them. ``observer``, when given, is pushed above torch's mode in the forward."""

    def __init__(
        self,
        inner: TorchDispatchMode,
        guard: _MutationGuard,
        *,
        forward: bool,
        observer: _OutputObserver | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.guard = guard
        self.forward = forward
        self.observer = observer

    def __enter__(self) -> _GuardedMode:
        if not self.forward:
            self.guard.before_recompute(self.inner.storage)
            self.guard.recompute_calls.clear()
        self.inner.__enter__()
        if self.observer is not None:
            self.observer.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> Any:
        if self.observer is not None:
            self.observer.__exit__(exc_type, exc_value, traceback)
        result = self.inner.__exit__(exc_type, exc_value, traceback)
        if self.forward and exc_type is None:
            self.guard.after_forward(self.inner.storage)
        return result

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise AssertionError("remat's guarded selective-checkpoint mode is never pushed itself")

    @property
    def ac_graph_id(self) -> Any:
        """torch.compile tags the forward mode with the id of its checkpointed graph: it belongs to torch's mode."""
        return getattr(self.inner, "ac_graph_id", None)

    @ac_graph_id.setter
    def ac_graph_id(self, value: Any) -> None:
        self.inner.ac_graph_id = value


POLICY_SEES_OUTPUT: bool = "op_output" in inspect.signature(SelectiveCheckpointContext.__init__).parameters
"""Whether torch asks the policy after the op ran, with ``ctx.op_output`` (torch 2.13+; public API). Otherwise
(torch 2.11) :func:`guarded_contexts` pushes an :class:`_OutputObserver` to see the outputs."""


def guarded_contexts(policy_fn: PolicyFn, *, report: Downgraded, observe_outputs: bool | None = None) -> ContextPair:
    """``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy_fn)``, except that backward never gets a
    cached output that was written in place after it was cached: such an entry is recomputed instead.

    ``policy_fn(ctx, op, *args, **kwargs)`` is any torch selective-checkpoint policy. On top of it, an op that writes
    into one of its inputs is never cached (its cached result would replace the call in recompute and the write into
    the recomputed input would be lost). Every op the policy sees that writes into the storage of a cached output,
    every non-view output sharing such a storage whose version moves (``torch.matmul``'s ``_unsafe_view``), and
    every change of a cached output's version counter downgrades that cache entry to recompute: at the exit of the
    checkpointed forward (the memory is released then) or, for writes after the region, right before recompute.
    The policy is asked in the forward only; torch versions that ask again in the recompute get the forward's
    decisions replayed. ``report(op, cause)`` is told of each entry downgraded.
    ``observe_outputs`` (default: when torch does not pass ``ctx.op_output``) sees the outputs through a dispatch
    mode of its own instead of the policy's context.
    """
    layout = sac_layout()
    guard = _MutationGuard(layout, report)
    observe = not POLICY_SEES_OUTPUT if observe_outputs is None else observe_outputs
    replay = layout.policy_called_in_recompute

    def guarded_policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> TorchCheckpointPolicy:
        if ctx.is_recompute:
            return guard.replayed(op)
        policy = policy_fn(ctx, op, *args, **kwargs)
        if isinstance(policy, bool):
            policy = TorchCheckpointPolicy.MUST_SAVE if policy else TorchCheckpointPolicy.PREFER_RECOMPUTE
        saved = policy in (TorchCheckpointPolicy.MUST_SAVE, TorchCheckpointPolicy.PREFER_SAVE)
        if saved and _facts(op).written:
            policy, saved = TorchCheckpointPolicy.PREFER_RECOMPUTE, False
        if replay:
            guard.forward_saved[op].append(saved)
        if observe:
            guard.pending = saved
        else:
            guard.observe(op, args, kwargs, ctx.op_output, saved)
        return policy

    forward, recompute = create_selective_checkpoint_contexts(guarded_policy)
    observer = _OutputObserver(guard, getattr(policy_fn, "output_seen", None)) if observe else None
    return (
        _GuardedMode(forward, guard, forward=True, observer=observer),
        _GuardedMode(recompute, guard, forward=False),
    )
