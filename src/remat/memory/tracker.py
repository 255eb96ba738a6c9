"""Exact live-tensor accounting: every storage created inside the tracker, from its creating op until it dies.

`LiveTensorTracker` is a `TorchDispatchMode`. After each aten op it registers the untyped storages of the op's
fresh outputs (ops whose schema says an output aliases an input, i.e. views and in-place/out= ops, create
nothing), keyed by storage identity, and holds a weak reference whose callback subtracts the storage's bytes the
moment the storage really dies. The live byte count is therefore exact at every op boundary, for real CPU/CUDA
tensors and for fake tensors alike, through autograd backward and through non-reentrant checkpoint recompute.

Storages created inside `LiveTensorTracker.host_allocations` (the host copies of an activation-offloading context)
are counted apart, in host bytes (`host_bytes`, `host_peak_bytes`), and never in the device figures.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from remat.memory import storage_resize

CATEGORIES: Final[tuple[str, ...]] = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer_state",
    "activations",
    "temporaries",
)
_PARAMETERS, _BUFFERS, _GRADIENTS, _OPTIMIZER_STATE, _ACTIVATIONS, _TEMPORARIES = range(len(CATEGORIES))

StorageListener = Callable[[str, int, int, str], None]
"""``listener(event, serial, nbytes, category)``, told of every change the tracker counts. ``event`` is "alloc" (a
storage starts being counted), "free" (it died), "resize" (its size changed to ``nbytes``) or "category" (it moved
to ``category``); ``serial`` identifies the storage for its whole life and is never reused within one measurement.
"phase" (serial and bytes 0, ``category`` "backward" or "forward") says autograd entered or left a backward pass:
entering it re-files the live forward temporaries as activations (the "category" events that follow)."""

_current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
_FAKE_MODE_KEY = torch._C._TorchDispatchModeKey.FAKE


def pinned_block_bytes(nbytes: int) -> int:
    """The bytes PyTorch's caching host allocator takes for a pinned buffer of ``nbytes``: the next power of two (its
    blocks are power-of-two sized so that freed ones are reused; they stay cached, pinned, for later copies)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def _active_fake_mode() -> Any:
    """The fake-tensor mode in effect (None on real tensors)."""
    return torch._C._get_dispatch_mode(_FAKE_MODE_KEY)

# Per-op and per-type facts, computed once per process.
_OP_ALLOCATES: dict[Any, bool] = {}
_TYPE_DEFERS: dict[type, bool] = {}


def _op_allocates(func: Any) -> bool:
    """True when no output of `func` aliases an input by its schema (so its outputs are fresh storages)."""
    allocates = _OP_ALLOCATES.get(func)
    if allocates is None:
        schema = getattr(func, "_schema", None)
        if schema is None:  # a higher-order operator (e.g. torch.cond): its outputs are fresh
            _OP_ALLOCATES[func] = True
            return True
        # unsafe_split / unsafe_chunk return views while their schema claims otherwise; lift_fresh is declared
        # aliasing but its input is a tensor just built from Python data (torch.tensor(...)), seen by no op.
        allocates = schema.name == "aten::lift_fresh" or (
            not schema.name.startswith("aten::unsafe_") and all(ret.alias_info is None for ret in schema.returns)
        )
        _OP_ALLOCATES[func] = allocates
    return allocates


def _defers_to_subclass(types: Iterable[type]) -> bool:
    """True when a wrapper subclass (e.g. DTensor) is involved: let it desugar into ops on its local tensors."""
    for tensor_type in types:
        defers = _TYPE_DEFERS.get(tensor_type)
        if defers is None:
            defers = is_traceable_wrapper_subclass_type(tensor_type)
            _TYPE_DEFERS[tensor_type] = defers
        if defers:
            return True
    return False


def _storages_of(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The untyped storages behind `tensor`, looking through traceable wrapper subclasses such as DTensor."""
    pending = [tensor]
    storages: list[torch.UntypedStorage] = []
    while pending:
        t = pending.pop()
        if is_traceable_wrapper_subclass_type(type(t)):
            inner_names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
            pending.extend(getattr(t, name) for name in inner_names if isinstance(getattr(t, name), torch.Tensor))
            continue
        try:
            storages.append(t.untyped_storage())
        except (RuntimeError, NotImplementedError):  # sparse / nested tensors without one storage
            continue
    return storages


class _StorageRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to one tracked storage, carrying what the tracker knows about it."""

    __slots__ = ("key", "nbytes", "category", "born")

    def __new__(cls, storage: torch.UntypedStorage, callback: Any, *_: Any) -> _StorageRef:
        return super().__new__(cls, storage, callback)

    def __init__(
        self, storage: torch.UntypedStorage, callback: Any, key: int, nbytes: int, category: int, born: int
    ) -> None:
        super().__init__(storage, callback)
        self.key = key
        self.nbytes = nbytes
        self.category = category
        self.born = born


class LiveTensorTracker(TorchDispatchMode):
    """Exact live tensor bytes, their peak and a breakdown by category, over the code inside `with tracker:`.

    Counting: every untyped storage created by an aten op inside the block is counted once (by storage identity,
    at its `nbytes`) until it is freed; views and in-place ops add nothing. Without `module`/`optimizer`, all
    figures are bytes *above* what was alive at entry. With them, the parameters and buffers of `module`, the
    parameters of `optimizer`'s param groups, their `.grad` tensors and the optimizer's state tensors alive at
    entry are counted from the start (the baseline), so `peak_bytes` is the whole step's peak like the CUDA
    allocator's (minus allocator rounding and caching).

    Categories (`peak_breakdown`, `current_breakdown`):
    - "parameters", "buffers": of `module` / `optimizer` at entry.
    - "gradients": `.grad` of those parameters, alive at entry or accumulated inside (post-accumulate-grad hooks).
    - "optimizer_state": tensors in `optimizer.state`, at entry and after each `optimizer.step()` (step hook).
    - "activations": storages created outside backward that are still alive when a backward pass begins: what
      autograd saved for backward, the block inputs a non-reentrant checkpoint keeps for recompute, and anything
      the caller itself still holds then (logits, the loss). Saved-tensor hooks are not used because tensors
      saved inside a checkpointed region never reach them. Tensors recomputed during backward count as
      temporaries.
    - "temporaries": everything else.
    Reclassification is applied to the recorded peak too whenever the storage was already alive at the peak, so
    `peak_breakdown` always sums to `peak_bytes`.

    Works on real tensors, under `FakeTensorMode` (enter the tracker *inside* the fake mode), through
    `torch.utils.checkpoint` (non-reentrant, selective contexts included) and with DTensor (it sees the local
    ops). Ops run under another fake mode than the block's are not counted (DTensor runs ops on global-shape fake
    tensors there to infer shapes). Allocations inside a single kernel (workspaces) are not visible. A `listener` (see `StorageListener`) is
    told of every allocation, free, resize and reclassification, in order (used to replay the step through an
    allocator model). Values freeze when the block exits;
    entering again starts a new measurement. Entering a tracker that is already active raises `RuntimeError`;
    two different trackers may be nested and each counts everything inside it.

    Host memory: storages created inside `host_allocations()` (give it to an offloading context as its
    ``host_scope``) are host copies. They count in `host_bytes` / `host_peak_bytes` only, never in `current_bytes`,
    `peak_bytes` or a category, and the listener is not told of them. ``host_rounding`` (None: exact bytes) maps a
    host storage's bytes to what its allocator takes for it (e.g. `pinned_block_bytes`).
    """

    # Higher-order operators (flex_attention, ...) come to __torch_dispatch__ as one op: their outputs are
    # counted, what they allocate and free inside is not.
    supports_higher_order_operators = True

    def __init__(
        self,
        *,
        module: nn.Module | None = None,
        optimizer: Optimizer | None = None,
        listener: StorageListener | None = None,
        host_rounding: Callable[[int], int] | None = None,
    ) -> None:
        super().__init__()
        self.host_rounding = host_rounding
        self._module = module
        self._optimizer = optimizer
        self._listener = listener
        self._fake_mode: Any = None
        self._active = False
        self._free_callback = self._on_free
        self._clear()

    # ------------------------------------------------------------------ public figures
    @property
    def current_bytes(self) -> int:
        """Bytes of tracked storages alive now (frozen at exit)."""
        return self._current

    @property
    def peak_bytes(self) -> int:
        """Highest `current_bytes` seen at any op boundary since entry or the last `reset_peak()`."""
        return self._peak

    @property
    def host_bytes(self) -> int:
        """Bytes of host storages (see `host_allocations`) alive now (frozen at exit)."""
        return self._host_current

    @property
    def host_peak_bytes(self) -> int:
        """Highest `host_bytes` since entry (not reset by `reset_peak`)."""
        return self._host_peak

    @contextlib.contextmanager
    def host_allocations(self) -> Iterator[None]:
        """Storages created by ops inside this block (on this tracker's thread) are host memory: counted in
        `host_bytes`, not in the device figures. Re-entrant."""
        self._host_depth += 1
        try:
            yield
        finally:
            self._host_depth -= 1

    @property
    def peak_breakdown(self) -> dict[str, int]:
        """Bytes per category (see class docstring) at the moment of the peak; sums to `peak_bytes`."""
        self._sync_phase()
        return dict(zip(CATEGORIES, self._peak_by_category, strict=True))

    @property
    def current_breakdown(self) -> dict[str, int]:
        """Bytes per category alive now; sums to `current_bytes`."""
        self._sync_phase()
        return dict(zip(CATEGORIES, self._by_category, strict=True))

    @property
    def peak_op(self) -> str | None:
        """Name of the op (e.g. "aten.mm.default") whose outputs made the peak; None if the peak is the entry."""
        return self._peak_op

    @property
    def peak_phase(self) -> str:
        """Label of the last `mark` before the peak; else the op at the peak; "entry" if nothing grew."""
        return self._peak_mark or self._peak_op or "entry"

    @property
    def marks(self) -> dict[str, int]:
        """`current_bytes` recorded by each `mark(label)`; a repeated label keeps its latest value."""
        return dict(self._marks)

    def mark(self, label: str) -> None:
        """Record `current_bytes` under `label` and make it the phase of any later peak."""
        self._sync_phase()
        self._marks[label] = self._current
        self._last_mark = label

    def serials_of(self, tensor: torch.Tensor) -> list[int]:
        """The serials (as told to the listener) of the tracked storages under ``tensor``."""
        out = []
        for storage in _storages_of(tensor):
            ref = self._refs.get(id(storage))
            if ref is not None and ref() is storage:
                out.append(ref.born)
        return out

    def reset_peak(self) -> None:
        """Start a new peak from the current bytes (marks are kept)."""
        self._peak = self._current
        self._peak_by_category = list(self._by_category)
        self._peak_seq = self._seq
        self._peak_op = None
        self._peak_mark = self._last_mark

    # ------------------------------------------------------------------ context management
    def __enter__(self) -> LiveTensorTracker:
        if self._active:
            raise RuntimeError("this LiveTensorTracker is already active; nest a second tracker instead")
        self._clear()
        self._fake_mode = _active_fake_mode()
        self._track_baseline()
        self._install_hooks()
        storage_resize.subscribe(self._on_storage_resized)
        self._active = True
        try:
            super().__enter__()
        except BaseException:
            self._deactivate()
            raise
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        try:
            super().__exit__(exc_type, exc_value, traceback)
        finally:
            self._deactivate()

    def _deactivate(self) -> None:
        self._active = False
        storage_resize.unsubscribe(self._on_storage_resized)
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        # Dropping the weak references disables their callbacks: the figures freeze here.
        self._refs = {}
        self._host_refs = {}

    def _clear(self) -> None:
        self._refs: dict[int, _StorageRef] = {}
        self._host_refs: dict[int, _StorageRef] = {}
        self._host_current = 0
        self._host_peak = 0
        self._host_depth = 0
        self._by_category = [0] * len(CATEGORIES)
        self._current = 0
        self._seq = 0
        self._marks: dict[str, int] = {}
        self._last_mark: str | None = None
        self._in_backward = False
        self._forward_start_seq = 0
        self._hook_handles: list[Any] = []
        self.reset_peak()

    # ------------------------------------------------------------------ the dispatch hook
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if types and _defers_to_subclass(types):
            return NotImplemented
        self._sync_phase()
        fake_mode = _active_fake_mode()
        if fake_mode is not None and fake_mode is not self._fake_mode:
            # Another fake mode than the one the block runs in (DTensor infers output shapes by running ops on
            # global-shape fake tensors in a private fake mode): nothing it makes is memory of the measured step.
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if self._host_depth:
            if _op_allocates(func):
                self._track_host(out)
        elif _op_allocates(func):
            self._track_outputs(out)
            if self._current > self._peak:
                self._record_peak(func)
        else:
            self._refresh_aliased(out, func)
        return out

    def _track_outputs(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self._track_new(out.untyped_storage() if out.layout == torch.strided else None)
        elif isinstance(out, (tuple, list)):
            for item in out:
                self._track_outputs(item)

    def _track_host(self, out: Any) -> None:
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
                storage = tensor.untyped_storage()
                if id(storage) not in self._host_refs and id(storage) not in self._refs:
                    nbytes = int(storage.nbytes())
                    if self.host_rounding is not None:
                        nbytes = self.host_rounding(nbytes)
                    self._host_refs[id(storage)] = _StorageRef(storage, self._on_host_free, id(storage), nbytes, -1, 0)
                    self._host_current += nbytes
                    self._host_peak = max(self._host_peak, self._host_current)

    def _on_host_free(self, ref: _StorageRef) -> None:
        if self._host_refs.get(ref.key) is ref:
            del self._host_refs[ref.key]
            self._host_current -= ref.nbytes

    def _track_new(self, storage: torch.UntypedStorage | None) -> None:
        if storage is not None and id(storage) not in self._refs:
            self._add(storage, _TEMPORARIES)

    def _refresh_aliased(self, out: Any, func: Any) -> None:
        """An aliasing op (view, in-place, out=, resize_) may have grown a tracked storage."""
        if isinstance(out, torch.Tensor) and out.layout == torch.strided:
            storage = out.untyped_storage()
            ref = self._refs.get(id(storage))
            if ref is not None:
                self._resize(ref, storage.nbytes(), func)

    # ------------------------------------------------------------------ bookkeeping
    def _add(self, storage: torch.UntypedStorage, category: int) -> _StorageRef:
        nbytes = int(storage.nbytes())
        self._seq += 1
        ref = _StorageRef(storage, self._free_callback, id(storage), nbytes, category, self._seq)
        self._refs[ref.key] = ref
        self._current += nbytes
        self._by_category[category] += nbytes
        if self._listener is not None:
            self._listener("alloc", ref.born, nbytes, CATEGORIES[category])
        return ref

    def _on_free(self, ref: _StorageRef) -> None:
        if self._refs.get(ref.key) is ref:
            del self._refs[ref.key]
            self._current -= ref.nbytes
            self._by_category[ref.category] -= ref.nbytes
            if self._listener is not None:
                self._listener("free", ref.born, ref.nbytes, CATEGORIES[ref.category])

    def _resize(self, ref: _StorageRef, nbytes: int, cause: Any) -> None:
        delta = int(nbytes) - ref.nbytes
        if delta:
            ref.nbytes += delta
            self._current += delta
            self._by_category[ref.category] += delta
            if self._listener is not None:
                self._listener("resize", ref.born, ref.nbytes, CATEGORIES[ref.category])
            if self._current > self._peak:
                self._record_peak(cause)

    def _on_storage_resized(self, storage: torch.UntypedStorage) -> None:
        ref = self._refs.get(id(storage))
        if ref is not None and ref() is storage:
            self._resize(ref, storage.nbytes(), "UntypedStorage.resize_")
        elif self._active and not self._host_depth and storage.nbytes() > 0:
            # NOTE [ Storages that grow back ]
            # FSDP2 keeps each unsharded parameter's storage for the whole run, resized to 0 between uses and
            # back to full size when it gathers the parameter again. A storage emptied before this tracker was
            # entered (in an earlier step) was never seen allocated; its growth is its allocation here.
            self._add(storage, _TEMPORARIES)
            if self._current > self._peak:
                self._record_peak("UntypedStorage.resize_")

    def _record_peak(self, cause: Any) -> None:
        self._peak = self._current
        self._peak_by_category = list(self._by_category)
        self._peak_seq = self._seq
        self._peak_op = str(cause)
        self._peak_mark = self._last_mark

    def _classify(self, tensor: torch.Tensor, category: int) -> None:
        """Put the storages of `tensor` in `category`, tracking them first if they were never seen."""
        for storage in _storages_of(tensor):
            ref = self._refs.get(id(storage))
            if ref is None:
                self._add(storage, category)
                if self._current > self._peak:
                    self._record_peak(CATEGORIES[category])
            else:
                self._reclassify(ref, category)

    def _reclassify(self, ref: _StorageRef, category: int) -> None:
        old = ref.category
        if old == category:
            return
        ref.category = category
        self._by_category[old] -= ref.nbytes
        self._by_category[category] += ref.nbytes
        if self._listener is not None:
            self._listener("category", ref.born, ref.nbytes, CATEGORIES[category])
        if ref.born <= self._peak_seq:  # alive now and born before the peak: it was part of the peak
            self._peak_by_category[old] -= ref.nbytes
            self._peak_by_category[category] += ref.nbytes

    def _sync_phase(self) -> None:
        """Notice autograd entering or leaving a backward pass (checked at every op, hook and query)."""
        if self._active and (_current_graph_task_id() != -1) != self._in_backward:
            self._switch_phase()

    def _switch_phase(self) -> None:
        self._in_backward = not self._in_backward
        if self._listener is not None:
            self._listener("phase", 0, 0, "backward" if self._in_backward else "forward")
        if self._in_backward:
            for ref in list(self._refs.values()):
                if ref.category == _TEMPORARIES and ref.born > self._forward_start_seq:
                    self._reclassify(ref, _ACTIVATIONS)
        else:
            self._forward_start_seq = self._seq

    # ------------------------------------------------------------------ baselines and hooks
    def _parameters(self) -> list[nn.Parameter]:
        params: dict[int, nn.Parameter] = {}
        if self._module is not None:
            params.update((id(p), p) for p in self._module.parameters())
        if self._optimizer is not None:
            for group in self._optimizer.param_groups:
                params.update((id(p), p) for p in group["params"])
        return list(params.values())

    def _track_baseline(self) -> None:
        params = self._parameters()
        for param in params:
            self._classify(param, _PARAMETERS)
        if self._module is not None:
            for buffer in self._module.buffers():
                self._classify(buffer, _BUFFERS)
        for param in params:
            if param.grad is not None:
                self._classify(param.grad, _GRADIENTS)
        self._classify_optimizer_state()
        self.reset_peak()

    def _classify_optimizer_state(self) -> None:
        if self._optimizer is None:
            return
        for state in self._optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._classify(value, _OPTIMIZER_STATE)

    def _install_hooks(self) -> None:
        for param in self._parameters():
            if param.requires_grad and param.is_leaf:
                self._hook_handles.append(param.register_post_accumulate_grad_hook(self._on_grad_accumulated))
        if self._optimizer is not None:
            self._hook_handles.append(self._optimizer.register_step_post_hook(self._on_optimizer_step))

    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        self._sync_phase()
        if param.grad is not None:
            self._classify(param.grad, _GRADIENTS)

    def _on_optimizer_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._classify_optimizer_state()
