"""Activation offloading: keep what autograd saves for backward in host memory instead of on the accelerator.

:class:`OffloadActivations` is a context manager built on ``torch.autograd.graph.saved_tensors_hooks``. Its pack hook
copies each saved accelerator tensor into a host buffer (pinned, on a side CUDA stream so the copy overlaps the
forward's compute) and lets the device copy be freed; its unpack hook copies it back when backward needs it and
prefetches the next few tensors backward will ask for (backward reads saved tensors roughly in reverse order).

What is not offloaded: tensors smaller than ``min_bytes``; parameters, views of parameters, leaf tensors that require
grad and the parameters/buffers of ``module`` (someone else keeps those resident, so copying them frees nothing);
tensors already on the host; tensor subclasses such as DTensor. A tensor saved several times (the normalised input of
the q/k/v projections) is copied once.

Combining with checkpointing: enter the context *around* a non-reentrant ``torch.utils.checkpoint.checkpoint`` call.
Checkpoint saves the block's positional tensor inputs for recompute through the saved-tensor hooks active when it is
called (``_CheckpointFrame.save_inputs`` makes ``SavedTensor``s), so those inputs go to the host and come back right
before recompute; everything inside the region is recomputed (full) or cached by torch's selective-checkpoint storage,
which bypasses saved-tensor hooks, so selective's cached outputs stay on the device. Entered *inside* a checkpointed
region (between checkpoint's own hooks), the context steps aside: checkpoint owns those tensors, and replacing its hooks
would break recompute. A warning says so.

Host copies keep the tensor's strides when it is dense (a transposed operand stays transposed), so backward runs the
same kernels and gradients are bitwise unchanged. Like every saved-tensor hook, offloading disables autograd's check
that a saved tensor was not modified in place after being saved (the copy keeps the value at save time).

With ``copy_cpu_tensors=True`` tensors already on the CPU are copied into separate host buffers too: that saves no
memory, but exercises the same bookkeeping on a machine without an accelerator (tests, demonstrations, and the memory
estimate, whose fake tensors live on the CPU but stand for device tensors). ``host_scope`` is entered around the
allocation of each host buffer: a memory tracker passes its own (`remat.memory.LiveTensorTracker.host_allocations`)
to count the host copies as host memory, apart from the device's.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from remat.errors import ConfigError

__all__ = ["OffloadActivations", "OffloadStats"]

DEFAULT_MIN_BYTES = 1 << 20
"""Tensors below 1 MiB stay on the device: their transfer latency costs more than the memory is worth."""

@dataclasses.dataclass
class OffloadStats:
    """What an :class:`OffloadActivations` moved since it was built or last reset.

    ``offloaded_*`` count distinct host copies (a tensor saved by three ops is one copy, the other two saves count
    in ``deduplicated``); ``restored_*`` count copies back to the device, prefetched ones included (``prefetched``
    of them were started before backward asked); ``skipped`` counts saved tensors left alone, by reason:
    ``small``, ``parameter`` (parameters, their views, leaves that require grad, ``module`` parameters/buffers),
    ``host`` (already on the CPU), ``subclass`` (DTensor and other wrapper subclasses), ``layout`` (sparse and other
    non-strided tensors, meta tensors without data).
    """

    offloaded_tensors: int = 0
    offloaded_bytes: int = 0
    restored_tensors: int = 0
    restored_bytes: int = 0
    prefetched: int = 0
    deduplicated: int = 0
    skipped: Counter[str] = dataclasses.field(default_factory=Counter)


class _HostCopy:
    """One saved tensor's host buffer, shared by every save of that same tensor, plus its way back."""

    __slots__ = ("seq", "host", "device", "nbytes", "d2h_done", "saves", "live", "prefetched", "prefetch_done",
                 "__weakref__")

    def __init__(self, seq: int, host: torch.Tensor, device: torch.device, d2h_done: Any) -> None:
        self.seq = seq
        self.host = host
        self.device = device
        self.nbytes = host.numel() * host.element_size()
        self.d2h_done = d2h_done  # CUDA event after the device->host copy, or None
        self.saves = 1  # saves sharing this copy that have not been unpacked yet
        self.live: torch.Tensor | None = None  # restored and kept while other saves of it still wait for it
        self.prefetched: torch.Tensor | None = None  # restored ahead of its first unpack, until then held here
        self.prefetch_done: Any = None


def _dense_strides(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill a block of memory exactly once in some dimension order (contiguous up to a
    permutation): then a host buffer with the same strides holds it, and the restored tensor has its layout."""
    expected = 1
    for size, stride in sorted(zip(t.size(), t.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _host_buffer(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty host tensor for `t`, with `t`'s strides when possible: backward kernels then see the same layout
    and produce bitwise the same gradients (a transposed operand copied contiguous changes the rounding)."""
    if _dense_strides(t):
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu", pin_memory=pin)
    return torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=pin)


class _SyncCopies:
    """Copies on the calling thread's current stream, finished when the call returns (CPU, fake and non-CUDA)."""

    def to_host(self, t: torch.Tensor, pin: bool) -> tuple[torch.Tensor, Any]:  # pinning only matters for CUDA
        host = _host_buffer(t, pin=False)
        host.copy_(t)
        return host, None

    def to_device(self, copy: _HostCopy, *, prefetch: bool) -> tuple[torch.Tensor, Any]:
        return copy.host.to(copy.device, copy=True), None

    def wait(self, t: torch.Tensor, done: Any) -> None:
        return None


class _CudaCopies:
    """Asynchronous copies for CUDA tensors: device->host on a side stream, pinned host buffers, events.

    Stream rules: the side stream waits for the current stream before reading a tensor; the tensor is marked as
    used by the side stream (``record_stream``) so its memory is not reused before the copy ends; backward's stream
    waits for the copy's event before reading a restored tensor; a tensor restored on the side stream is marked as
    used by the consuming stream. Pinned host buffers are released by the caching host allocator only after the
    copies that used them complete.
    """

    def __init__(self, use_stream: bool) -> None:
        self.use_stream = use_stream
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def to_host(self, t: torch.Tensor, pin: bool) -> tuple[torch.Tensor, Any]:
        current = torch.cuda.current_stream(t.device)
        stream = self._side(t.device) if self.use_stream else current
        host = _host_buffer(t, pin)
        if stream is not current:
            stream.wait_stream(current)
            t.record_stream(stream)
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=pin)
            done = stream.record_event()
        return host, done

    def to_device(self, copy: _HostCopy, *, prefetch: bool) -> tuple[torch.Tensor, Any]:
        current = torch.cuda.current_stream(copy.device)
        stream = self._side(copy.device) if (prefetch and self.use_stream) else current
        with torch.cuda.stream(stream):
            if copy.d2h_done is not None:
                stream.wait_event(copy.d2h_done)
            restored = copy.host.to(copy.device, non_blocking=copy.host.is_pinned(), copy=True)
            done = stream.record_event()
        return restored, done

    def wait(self, t: torch.Tensor, done: Any) -> None:
        current = torch.cuda.current_stream(t.device)
        current.wait_event(done)
        t.record_stream(current)


def _inside_checkpointed_region() -> bool:
    """Whether the innermost saved-tensor hooks are a non-reentrant checkpoint's own (forward or recompute)."""
    top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    top = top_hooks(False) if top_hooks is not None else None
    if not top:
        return False
    name = getattr(top[0], "__qualname__", "")
    return name.startswith(("_checkpoint_hook.", "_recomputation_hook."))


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors autograd saves inside it live in host memory until backward needs them.

    Args:
        min_bytes: tensors smaller than this stay where they are.
        pin_memory: use pinned host buffers (needed for copies that overlap compute on CUDA).
        use_stream: on CUDA, copy on a side stream so transfers overlap compute; else on the current stream.
        prefetch: when backward restores a tensor, also start restoring up to this many tensors saved just before
            it (at most this many restored ahead of time at once); 0 restores each tensor only when asked.
        module: its parameters and buffers are resident, never offloaded (parameters are detected anyway; this adds
            buffers such as causal masks).
        copy_cpu_tensors: also copy tensors that are already on the CPU (see module docstring).
        host_scope: called for a context entered around each host-buffer allocation (see module docstring); the
            attribute of the same name may be set later.

    One instance may be entered many times (e.g. once per block forward, for every block of a model): its stats
    accumulate and prefetching follows the save order across all of them.
    """

    def __init__(
        self,
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        pin_memory: bool = True,
        use_stream: bool = True,
        prefetch: int = 2,
        module: nn.Module | None = None,
        copy_cpu_tensors: bool = False,
        host_scope: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        for name, value in (("min_bytes", min_bytes), ("prefetch", prefetch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"OffloadActivations({name}=...) got {value!r}; allowed: an integer >= 0")
        for name, flag in (("pin_memory", pin_memory), ("use_stream", use_stream),
                           ("copy_cpu_tensors", copy_cpu_tensors)):
            if not isinstance(flag, bool):
                raise ConfigError(f"OffloadActivations({name}=...) got {flag!r}; allowed: True or False")
        if module is not None and not isinstance(module, nn.Module):
            raise ConfigError(f"OffloadActivations(module=...) got {type(module).__name__}; allowed: an nn.Module")
        if host_scope is not None and not callable(host_scope):
            raise ConfigError(f"OffloadActivations(host_scope=...) got {type(host_scope).__name__}; allowed: a "
                              "callable returning a context manager, or None")
        super().__init__(self._pack, self._unpack)
        self.min_bytes = min_bytes
        self.pin_memory = pin_memory
        self.prefetch = prefetch
        self.copy_cpu_tensors = copy_cpu_tensors
        self.host_scope = host_scope
        self.stats = OffloadStats()
        self._module = module
        self._sync = _SyncCopies()
        self._cuda = _CudaCopies(use_stream)
        self._lock = threading.RLock()
        self._seq = 0
        # Live host copies in save order (seq, weak ref), for prefetching; dead entries are pruned on entry.
        self._order: list[tuple[int, weakref.ref[_HostCopy]]] = []
        self._outstanding: set[int] = set()  # seqs restored ahead of time and not consumed yet
        # storage -> {(offset, size, stride, dtype, version): copy}: the same tensor saved again reuses its copy.
        self._by_storage: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], weakref.ref[_HostCopy]]] = (
            weakref.WeakKeyDictionary()
        )
        self._resident: set[int] = set()
        self._depth = 0  # > 0 while our hooks are pushed
        self._entries = threading.local()  # per thread: for each active entry, whether it stepped aside
        self._warned_inside_checkpoint = False

    # ------------------------------------------------------------------ context management
    def _entry_stack(self) -> list[bool]:
        stack: list[bool] | None = getattr(self._entries, "stack", None)
        if stack is None:
            stack = self._entries.stack = []
        return stack

    def __enter__(self) -> OffloadActivations:  # type: ignore[override]
        if _inside_checkpointed_region():
            self._entry_stack().append(True)
            if not self._warned_inside_checkpoint:
                self._warned_inside_checkpoint = True
                warnings.warn(
                    "OffloadActivations was entered inside a non-reentrant checkpointed region: the region's "
                    "tensors are recomputed, not saved, so nothing there is offloaded. Enter it around the "
                    "checkpoint call to offload the checkpoint's inputs.",
                    stacklevel=2,
                )
            return self
        self._entry_stack().append(False)
        with self._lock:
            if self._depth == 0:
                self._prune()
                self._resident = self._resident_storages()
            self._depth += 1
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._entry_stack().pop():
            return
        super().__exit__(*exc)
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._resident = set()

    @property
    def host_bytes(self) -> int:
        """Bytes of host copies alive now: what this context holds in host memory (0 once backward is done)."""
        with self._lock:
            return sum(copy.nbytes for _, ref in self._order if (copy := ref()) is not None)

    def _prune(self) -> None:
        """Drop bookkeeping entries of host copies that died (their backward ran, or their graph was freed)."""
        self._order = [entry for entry in self._order if entry[1]() is not None]
        for storage, keys in list(self._by_storage.items()):
            for key in [key for key, ref in keys.items() if ref() is None]:
                del keys[key]
            if not keys:
                del self._by_storage[storage]

    def reset_stats(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self.stats = OffloadStats()

    def _resident_storages(self) -> set[int]:
        if self._module is None:
            return set()
        tensors = [*self._module.parameters(), *self._module.buffers()]
        return {id(t.untyped_storage()) for t in tensors if not is_traceable_wrapper_subclass(t)}

    # ------------------------------------------------------------------ pack
    def _skip_reason(self, t: torch.Tensor) -> str | None:
        if is_traceable_wrapper_subclass(t):
            return "subclass"
        if t.layout != torch.strided or t.device.type == "meta":
            return "layout"
        if t.device.type == "cpu" and not self.copy_cpu_tensors:
            return "host"
        if t.numel() * t.element_size() < self.min_bytes:
            return "small"
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return "parameter"
        if id(t.untyped_storage()) in self._resident:
            return "parameter"
        return None

    def _copies(self, device: torch.device, tensor: torch.Tensor) -> _SyncCopies | _CudaCopies:
        """The asynchronous CUDA path for real CUDA tensors; synchronous copies for everything else."""
        return self._cuda if device.type == "cuda" and not is_fake(tensor) else self._sync

    def _pack(self, t: torch.Tensor) -> Any:
        reason = self._skip_reason(t)
        if reason is not None:
            with self._lock:
                self.stats.skipped[reason] += 1
            return t.detach()  # detached: holding `t` itself would tie its grad_fn to this saved value (a cycle)
        storage = t.untyped_storage()
        key = (t.storage_offset(), tuple(t.size()), tuple(t.stride()), t.dtype, t._version)
        with self._lock:
            same_storage = self._by_storage.get(storage)
            existing = same_storage.get(key) if same_storage is not None else None
            copy = existing() if existing is not None else None
            if copy is not None:
                copy.saves += 1
                self.stats.deduplicated += 1
                return copy
        with self.host_scope() if self.host_scope is not None else nullcontext():
            host, done = self._copies(t.device, t).to_host(t, self.pin_memory)
        with self._lock:
            self._seq += 1
            copy = _HostCopy(self._seq, host, t.device, done)
            self._order.append((copy.seq, weakref.ref(copy, self._forget(copy.seq))))
            self._by_storage.setdefault(storage, {})[key] = weakref.ref(copy)
            self.stats.offloaded_tensors += 1
            self.stats.offloaded_bytes += copy.nbytes
        return copy

    def _forget(self, seq: int) -> Any:
        """A weakref callback: a copy that dies before its prefetched tensor was used frees its budget slot."""
        owner = weakref.ref(self)

        def callback(_: object) -> None:
            offload = owner()
            if offload is not None:
                with offload._lock:
                    offload._outstanding.discard(seq)

        return callback

    # ------------------------------------------------------------------ unpack
    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        copy: _HostCopy = packed
        with self._lock:
            restored = copy.live if copy.live is not None else self._take_prefetched(copy)
        if restored is None:  # restored on the current stream: ready for backward in stream order
            restored, _ = self._copies(copy.device, copy.host).to_device(copy, prefetch=False)
            self._count_restored(copy)
        with self._lock:
            # Several saves of one tensor share one restored tensor, held from the first unpack to the last (as
            # the device tensor itself would have been); more unpacks than saves (retain_graph) restore again.
            copy.saves -= 1
            copy.live = restored if copy.saves > 0 else None
        self._prefetch_before(copy)
        return restored

    def _take_prefetched(self, copy: _HostCopy) -> torch.Tensor | None:
        restored = copy.prefetched
        if restored is None:
            return None
        copy.prefetched = None
        self._outstanding.discard(copy.seq)
        if copy.prefetch_done is not None:
            self._cuda.wait(restored, copy.prefetch_done)
            copy.prefetch_done = None
        return restored

    def _count_restored(self, copy: _HostCopy, *, prefetched: bool = False) -> None:
        with self._lock:
            self.stats.restored_tensors += 1
            self.stats.restored_bytes += copy.nbytes
            self.stats.prefetched += int(prefetched)

    def _prefetch_before(self, copy: _HostCopy) -> None:
        """Restore ahead of time the live copies saved just before `copy`, up to the prefetch budget."""
        if self.prefetch == 0:
            return
        with self._lock:
            candidates: list[_HostCopy] = []
            index = bisect.bisect_left(self._order, copy.seq, key=lambda entry: entry[0]) - 1
            budget = self.prefetch - len(self._outstanding)
            stop = max(-1, index - 4 * self.prefetch)  # look at a few entries only: unpacks stay O(prefetch)
            while index > stop and len(candidates) < budget:
                earlier = self._order[index][1]()
                index -= 1
                if earlier is None or earlier.saves <= 0 or earlier.live is not None or earlier.prefetched is not None:
                    continue
                candidates.append(earlier)
                self._outstanding.add(earlier.seq)
        for earlier in candidates:
            restored, done = self._copies(earlier.device, earlier.host).to_device(earlier, prefetch=True)
            with self._lock:
                earlier.prefetched, earlier.prefetch_done = restored, done
            self._count_restored(earlier, prefetched=True)
