"""How each supported torch stores the cache of selective activation checkpointing, behind one small interface.

``torch.utils.checkpoint.create_selective_checkpoint_contexts(policy_fn)`` returns a caching mode (the forward)
and a cached mode (the recompute) that share a ``.storage``. Its public contract says nothing about that storage,
but keeping an output that the forward wrote into *after* it was cached out of backward means taking its entry
back out. This module is the only place that touches the storage. Two layouts exist among the torch versions remat
supports (``torch>=2.11,<2.16``); :func:`sac_layout` detects which one the running torch has by its features, not
its version number, and raises a :class:`~remat.errors.CheckpointingError` naming the torch version when neither
fits, so a torch that moves these internals fails loudly instead of caching mutated values.

- :class:`IndexedLayout` (torch 2.13 to 2.15): ``storage = {op key: {call index: entry}}`` holds an entry for every
  call, the ``_RECOMPUTE`` sentinel or ``tree_map(_VersionWrapper, output)``; the policy is called in the forward
  only, after the op ran (``ctx.op_output``), and recompute replays the entries by call index. Dropping an entry
  means replacing it by the sentinel.
- :class:`QueueLayout` (torch 2.11): ``storage = {op: [entry of each saved call, in call order]}``; the policy is
  called before the op runs (no ``ctx.op_output``) in the forward, and again for every call of the recompute
  (``ctx.is_recompute=True``), where a "save" answer pops the next entry of that op's queue. Dropping an entry means
  removing it from the queue *and* answering "recompute" for that call in the recompute: the guard therefore
  replays the forward's decisions by call index (``forward_saved``) instead of asking the policy again.

In both, a ``_VersionWrapper`` holds ``.val`` (the detached output, sharing its storage and version counter) and
``.version`` (the version when it was cached). ``tests/checkpointing/test_sac_layout.py`` checks the layout of the
running torch entry by entry; CI runs it on torch 2.11, 2.13 and 2.15.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from remat.errors import CheckpointingError

__all__ = ["CachedEntry", "IndexedLayout", "QueueLayout", "SacLayout", "sac_layout"]

Storage = MutableMapping[Any, Any]
ForwardSaved = dict[Any, list[bool]]
"""Per op (the key torch's storage uses), whether each call of the forward was cached, in call order."""


@dataclasses.dataclass(frozen=True)
class CachedEntry:
    """One cached output in torch's storage: its op key, where it sits (layout-specific) and its version wrappers."""

    key: Any
    slot: int
    wrappers: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class IndexedLayout:
    """torch 2.13-2.15: ``{key: {call index: _RECOMPUTE | tree of _VersionWrapper}}``, replayed by index."""

    version_wrapper: type
    recompute: object
    name: str = "indexed"
    policy_called_in_recompute: bool = False

    def cached(self, storage: Storage, forward_saved: ForwardSaved) -> Iterator[CachedEntry]:
        """Every entry that still holds tensors (not the sentinel, not consumed)."""
        for key, entries in storage.items():
            for index, entry in entries.items():
                if entry is not self.recompute:
                    wrappers = _tensor_wrappers(entry, self.version_wrapper)
                    if wrappers:
                        yield CachedEntry(key, index, wrappers)

    def drop(self, storage: Storage, forward_saved: ForwardSaved, entries: list[CachedEntry]) -> None:
        """Make recompute re-run these calls instead of reading their outputs."""
        for entry in entries:
            storage[entry.key][entry.slot] = self.recompute


@dataclasses.dataclass(frozen=True)
class QueueLayout:
    """torch 2.11: ``{op: [tree of _VersionWrapper per saved call]}``, popped when the recompute's policy says save."""

    version_wrapper: type
    name: str = "queue"
    policy_called_in_recompute: bool = True

    def cached(self, storage: Storage, forward_saved: ForwardSaved) -> Iterator[CachedEntry]:
        """Every queued entry, with the forward call index it came from as its slot."""
        for key, queue in storage.items():
            calls = [index for index, saved in enumerate(forward_saved.get(key, ())) if saved]
            if len(calls) != len(queue):
                if _traced(queue, self.version_wrapper):
                    continue  # torch.compile tracing caches every call; its fake tensors hold no data to guard
                raise CheckpointingError(
                    f"selective checkpointing: torch {torch.__version__} cached {len(queue)} outputs of {key} but "
                    f"the policy saved {len(calls)}; the layout of torch.utils.checkpoint's cache is not the one "
                    f"remat knows for this torch. Use policy 'full' until remat supports it"
                )
            for index, entry in zip(calls, queue, strict=True):
                wrappers = _tensor_wrappers(entry, self.version_wrapper)
                if wrappers:
                    yield CachedEntry(key, index, wrappers)

    def drop(self, storage: Storage, forward_saved: ForwardSaved, entries: list[CachedEntry]) -> None:
        """Take the entries out of their queues and mark their calls "recompute" for the recompute's policy."""
        by_key: dict[Any, set[int]] = {}
        for entry in entries:
            by_key.setdefault(entry.key, set()).add(entry.slot)
        for key, slots in by_key.items():
            calls = [index for index, saved in enumerate(forward_saved[key]) if saved]
            storage[key][:] = [e for index, e in zip(calls, storage[key], strict=True) if index not in slots]
            for index in slots:
                forward_saved[key][index] = False


SacLayout = IndexedLayout | QueueLayout


def _traced(queue: list[Any], version_wrapper: type) -> bool:
    """Whether the queue holds tensor subclasses (fake/functional tensors while torch.compile traces)."""
    return any(type(w.val) is not torch.Tensor for entry in queue for w in _tensor_wrappers(entry, version_wrapper))


def _tensor_wrappers(entry: Any, version_wrapper: type) -> tuple[Any, ...]:
    leaves = (entry,) if isinstance(entry, version_wrapper) else tree_leaves(entry)
    return tuple(w for w in leaves if isinstance(w, version_wrapper) and isinstance(w.val, torch.Tensor))


_detected: list[SacLayout] = []


def sac_layout() -> SacLayout:
    """The cache layout of the running torch (checked once per process); a CheckpointingError if it is unknown."""
    if not _detected:
        _detected.append(_detect())
    return _detected[0]


def _detect() -> SacLayout:
    from torch.utils import checkpoint as torch_checkpoint

    problems: list[str] = []
    wrapper_type = getattr(torch_checkpoint, "_VersionWrapper", None)
    if not isinstance(wrapper_type, type):
        problems.append("torch.utils.checkpoint._VersionWrapper is gone")
    else:
        probe = wrapper_type(torch.zeros(1))
        if not (isinstance(getattr(probe, "val", None), torch.Tensor) and getattr(probe, "version", None) == 0):
            problems.append("_VersionWrapper no longer has .val and .version")
    forward, recompute = create_selective_checkpoint_contexts(_never_save)
    storage = getattr(forward, "storage", None)
    factory: Callable[[], Any] | None = getattr(storage, "default_factory", None)
    if not isinstance(storage, dict) or getattr(recompute, "storage", None) is not storage:
        problems.append("the two selective-checkpoint modes no longer share a .storage dict")
    elif factory not in (dict, list):
        problems.append(f"its .storage holds {factory!r} per op, neither {{call index: entry}} nor [entry, ...]")
    sentinel = getattr(torch_checkpoint, "_RECOMPUTE", None)
    if factory is dict and sentinel is None:
        problems.append("its .storage is indexed by call but torch.utils.checkpoint._RECOMPUTE is gone")
    if problems:
        raise CheckpointingError(
            f"remat's selective checkpointing keeps outputs mutated in place out of torch's selective-checkpoint "
            f"cache, and knows how torch 2.11-2.15 store it; torch {torch.__version__} changed it: "
            f"{'; '.join(problems)}. Use policy 'full' (exact, no op-level cache) until remat supports this torch"
        )
    assert isinstance(wrapper_type, type)
    if factory is dict:
        return IndexedLayout(version_wrapper=wrapper_type, recompute=sentinel)
    return QueueLayout(version_wrapper=wrapper_type)


def _never_save(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE
