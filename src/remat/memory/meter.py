"""The per-step peak-memory figure of the training log (`| mem 0.41 GiB |`), from the best source available."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Final, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from remat.errors import ConfigError
from remat.memory import rss
from remat.memory.tracker import LiveTensorTracker

MemorySource = Literal["auto", "cuda", "tracked", "rss"]
MEMORY_SOURCES: Final[tuple[str, ...]] = get_args(MemorySource)

_DESCRIPTIONS: Final[dict[str, str]] = {
    "cuda": "CUDA allocator peak (max_memory_allocated)",
    "tracked": "exact peak of live tensor bytes (tracked)",
    "rss": "peak resident set size of the process during the step",
    "rss-lifetime": "peak resident set size over the whole process lifetime",
}


@dataclasses.dataclass(frozen=True)
class MemoryReading:
    """One step's peak memory and where the figure comes from.

    `source` is "cuda", "tracked", "rss" (peak RSS during the step) or "rss-lifetime" (the kernel's peak could not
    be reset, so this is the process-lifetime peak). `breakdown` (bytes per category) and `phase` (last mark
    before the peak, or the op at the peak) are set for "tracked" readings only.
    """

    peak_bytes: int
    source: str
    breakdown: Mapping[str, int] | None = None
    phase: str | None = None

    def format_gib(self, digits: int = 2) -> str:
        """The peak in GiB, e.g. "0.41 GiB"."""
        return f"{self.peak_bytes / 2**30:.{digits}f} GiB"

    @property
    def description(self) -> str:
        """What the figure measures, in words, for logs and docs."""
        return _DESCRIPTIONS.get(self.source, self.source)


def max_over_ranks(reading: MemoryReading, group: dist.ProcessGroup | None = None) -> MemoryReading:
    """The largest `peak_bytes` over all ranks when torch.distributed is initialised; `reading` itself otherwise.

    The result keeps the local `source`; `breakdown` and `phase` are dropped because they describe this rank only.
    Every rank of `group` must call it (it is a collective).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return reading
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    peak = torch.tensor([reading.peak_bytes], dtype=torch.int64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return MemoryReading(peak_bytes=int(peak.item()), source=reading.source)


def _device_of(model: nn.Module | None) -> torch.device | None:
    if model is None:
        return None
    for tensor in model.parameters():
        return tensor.device
    return None


class StepMemoryMeter:
    """Measures the peak memory of each training step: `with meter.step(): ...`, then `meter.last`.

    Sources: "cuda" resets and reads the CUDA allocator's peak (`max_memory_allocated`) of `device`; "tracked"
    runs a `LiveTensorTracker` with the model and optimizer baselines around the step, so the figure includes
    parameters, gradients and optimizer state like the allocator's; "rss" reads the process's peak RSS (reset per
    step where Linux allows it, else the process-lifetime peak, reported as source "rss-lifetime"). "auto" picks
    "cuda" when the model (or `device`) is on a CUDA device, or when neither is given and CUDA is available;
    "tracked" otherwise.

    The model and optimizer can be given here or per step (`step(model=..., optimizer=...)`, which wins). The
    optimizer's state only exists after its first `step()`: the tracker counts state created inside a measured
    step from then on.
    """

    def __init__(
        self,
        source: MemorySource = "auto",
        *,
        model: nn.Module | None = None,
        optimizer: Optimizer | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if source not in MEMORY_SOURCES:
            raise ConfigError(
                f"memory source: got {source!r}; allowed: {', '.join(repr(s) for s in MEMORY_SOURCES)}"
            )
        self._model = model
        self._optimizer = optimizer
        self._device = torch.device(device) if device is not None else _device_of(model)
        self._source = self._resolve(source)
        self._tracker: LiveTensorTracker | None = None
        self._last: MemoryReading | None = None

    def _resolve(self, source: str) -> str:
        if source == "auto":
            on_cuda = self._device.type == "cuda" if self._device is not None else torch.cuda.is_available()
            return "cuda" if on_cuda else "tracked"
        if source == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError(
                    "memory source: got 'cuda' but torch.cuda.is_available() is False; allowed here: "
                    "'auto', 'tracked', 'rss'"
                )
            if self._device is not None and self._device.type != "cuda":
                raise ConfigError(
                    f"memory source: got 'cuda' for a model on {self._device}; allowed for it: "
                    "'auto', 'tracked', 'rss'"
                )
        return source

    @property
    def source(self) -> str:
        """The resolved source: "cuda", "tracked" or "rss"."""
        return self._source

    @property
    def last(self) -> MemoryReading:
        """The reading of the last step that completed without an exception."""
        if self._last is None:
            raise RuntimeError("no step has been measured yet: use `with meter.step(): ...` first")
        return self._last

    def mark(self, label: str) -> None:
        """Name a point of the step (e.g. "after_forward") for a tracked reading's `phase`; ignored otherwise."""
        if self._tracker is not None:
            self._tracker.mark(label)

    def peak_so_far(self) -> int:
        """The peak of the step being measured, up to now (for a check inside the step, e.g. before the optimizer
        update): the tracker's peak, the CUDA allocator's (synchronised first) or the peak RSS. Call it inside
        `step`."""
        if self._source == "cuda":
            device = self._cuda_device(self._model)
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device))
        if self._source == "rss":
            return rss.read_vm_hwm() or rss.lifetime_peak_rss()
        if self._tracker is None:
            raise RuntimeError("peak_so_far: no step is being measured; call it inside `with meter.step(): ...`")
        return int(self._tracker.peak_bytes)

    @contextmanager
    def step(self, *, model: nn.Module | None = None, optimizer: Optimizer | None = None) -> Iterator[None]:
        """Measure the peak of the code inside the block; the reading is in `last` afterwards."""
        if self._source == "cuda":
            yield from self._cuda_step(model or self._model)
        elif self._source == "rss":
            yield from self._rss_step()
        else:
            yield from self._tracked_step(model or self._model, optimizer or self._optimizer)

    def _cuda_device(self, model: nn.Module | None) -> torch.device:
        device = _device_of(model) or self._device
        if device is None or device.type != "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return device

    def _cuda_step(self, model: nn.Module | None) -> Iterator[None]:
        device = self._cuda_device(model)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield
        torch.cuda.synchronize(device)
        self._last = MemoryReading(peak_bytes=int(torch.cuda.max_memory_allocated(device)), source="cuda")

    def _rss_step(self) -> Iterator[None]:
        per_step = rss.reset_peak_rss()
        yield
        hwm = rss.read_vm_hwm() if per_step else None
        if hwm is not None:
            self._last = MemoryReading(peak_bytes=hwm, source="rss")
        else:
            self._last = MemoryReading(peak_bytes=rss.lifetime_peak_rss(), source="rss-lifetime")

    def _tracked_step(self, model: nn.Module | None, optimizer: Optimizer | None) -> Iterator[None]:
        tracker = LiveTensorTracker(module=model, optimizer=optimizer)
        self._tracker = tracker
        try:
            with tracker:
                yield
        finally:
            self._tracker = None
        self._last = MemoryReading(
            peak_bytes=tracker.peak_bytes,
            source="tracked",
            breakdown=tracker.peak_breakdown,
            phase=tracker.peak_phase,
        )
