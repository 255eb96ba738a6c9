"""Optional CUDA kernels behind ``FusedLinearCrossEntropy(backend=...)``: cut-cross-entropy and liger-kernel.

Neither is a dependency (``pip install remat[cuda-kernels]``, which allows cut-cross-entropy 25.x and
liger-kernel 0.8.x). They run only on CUDA tensors, and each only for what it can do (:func:`kernel_refusal`);
everywhere else, and whenever the package cannot be imported, the pure-PyTorch implementation runs instead. The
choice, and why a kernel was skipped, is logged once per (requested backend, device type, outcome).

The calls follow the signatures of those versions (:func:`kernel_arguments`; a test binds them to the installed
package's functions):

- ``cut_cross_entropy.linear_cross_entropy(e, c, targets, ignore_index=-100, softcap=None, reduction="mean",
  shift=False, filter_eps="high", impl="cce")``: no bias; its backward takes bf16/fp16 ``e`` only.
- ``liger_kernel.transformers.functional.liger_fused_linear_cross_entropy(input, weight, target, bias=None,
  ce_weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean", softcap=None,
  ...)``.

Both get the already-shifted flat targets with ``reduction="sum"``; remat divides, so ``num_label_tokens`` means the
same on every backend.
"""

from __future__ import annotations

import importlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from remat.errors import ConfigError

logger = logging.getLogger("remat.loss")

Backend = Literal["auto", "torch", "cce", "liger"]
BACKENDS: tuple[str, ...] = get_args(Backend)

#: Kernel backends in the order "auto" tries them, with the module and function each one calls.
KERNELS: dict[str, tuple[str, str]] = {
    "cce": ("cut_cross_entropy", "linear_cross_entropy"),
    "liger": ("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy"),
}
#: The distribution that provides each kernel backend (for messages and the version check).
DISTRIBUTIONS: dict[str, str] = {"cce": "cut-cross-entropy", "liger": "liger-kernel"}

_announced: set[tuple[str, str, str, tuple[str, ...]]] = set()


@dataclass(frozen=True)
class KernelRequest:
    """What one call of the fused loss asks of a kernel backend."""

    dtype: torch.dtype
    bias: bool
    softcap: float | None
    hidden_needs_grad: bool


def check_backend(backend: str) -> Backend:
    """Return ``backend`` if known, else raise a ConfigError naming ``loss_fn.backend``."""
    if backend not in BACKENDS:
        raise ConfigError(f"loss_fn.backend: got {backend!r}; allowed: {', '.join(map(repr, BACKENDS))}")
    return backend  # type: ignore[return-value]


def load_kernel(name: str) -> Callable[..., Tensor] | None:
    """The kernel function of backend ``name``, or None if its package is not installed or fails to import."""
    module_name, function_name = KERNELS[name]
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # a broken optional install (no triton, no driver) must not break the loss
        logger.debug("loss backend %r unavailable: importing %s failed: %s", name, module_name, error)
        return None
    return getattr(module, function_name, None)


def kernel_refusal(name: str, request: KernelRequest) -> str | None:
    """Why kernel backend ``name`` cannot compute ``request`` (None if it can)."""
    if request.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"it takes bf16/fp16/fp32 inputs, not {request.dtype}"
    if name == "cce":
        if request.bias:
            return "cut-cross-entropy's linear_cross_entropy takes no bias"
        if request.hidden_needs_grad and request.dtype == torch.float32:
            return "cut-cross-entropy's backward needs bf16/fp16 hidden states, not float32"
    return None


def select_backend(requested: Backend, device: torch.device, request: KernelRequest | None = None) -> str:
    """The backend that will run a call that names one: the requested kernel on CUDA if it imports and can do
    ``request``, else torch. ``"auto"`` here means the first usable kernel (cce, then liger), else torch; the fused
    loss itself decides ``"auto"`` by measurement (`fastest_backend`). ``request`` None means a plain bf16 call
    without bias or soft-cap."""
    if requested == "torch":
        return "torch"
    request = request or KernelRequest(torch.bfloat16, bias=False, softcap=None, hidden_needs_grad=True)
    usable, skipped = usable_kernels(tuple(KERNELS) if requested == "auto" else (requested,), device, request)
    chosen = usable[0] if usable else "torch"
    _announce(requested, device, chosen, skipped)
    return chosen


def usable_kernels(names: tuple[str, ...], device: torch.device,
                   request: KernelRequest) -> tuple[list[str], tuple[str, ...]]:
    """The kernel backends among ``names`` that can run ``request`` on ``device``, and why each other one cannot."""
    usable: list[str] = []
    skipped: list[str] = []
    for name in names:
        why = _why_not(name, device, request)
        if why is None:
            usable.append(name)
        else:
            skipped.append(f"{name}: {why}")
    return usable, tuple(skipped)


# NOTE [ The fused loss's backend is measured, not ranked ]
# Which fused loss is fastest depends on the GPU, the vocabulary, the hidden size and the number of tokens: on an
# H200 remat's compiled path took 0.36x cut-cross-entropy's time at every size and liger-kernel's was 1.9x slower at 4k
# tokens but 0.82x at 64k; in the seed step on an H100, cce made the step 29% slower than remat's path and liger was
# level with it without checkpointing and 5% faster under full checkpointing (benchmarks/results/loss_cuda.md,
# gpu_loss_backends_*.md). A fixed order cannot be right everywhere, so under "auto" the first call of each shape
# runs every usable backend on that call's own tensors (detached copies of nothing: the same storage, gradients to
# throw away), one warm-up and three timed calls each, and keeps the fastest for the process; remat's own path wins
# ties within TIE_MARGIN, being the one whose gradients the suite checks on every architecture. The choice and the
# times are logged once at INFO. The timing costs a few loss calls once per shape, never inside a graph capture or
# a compiled region, and no more memory than the loss call itself (one backend at a time, its gradients freed).

#: Timed calls per backend after one warm-up (which compiles, autotunes and fills caches).
TIMED_CALLS = 3
#: remat's own path ("torch") is kept unless another backend is faster by more than this fraction.
TIE_MARGIN = 0.02

_measured: dict[tuple[Any, ...], str] = {}


def fastest_backend(key: tuple[Any, ...], candidates: list[str], run: Callable[[str], None],
                    device: torch.device, *, measurable: bool = True) -> str:
    """The fastest of ``candidates`` ("torch" among them) for calls of ``key`` (the device, dtypes and shapes that
    decide speed): measured once by ``run(name)`` (one forward and backward of that backend) and remembered for the
    process. When nothing was measured yet and ``measurable`` is False (no gradients, a graph capture, a compiled
    region), "torch" without remembering."""
    if len(candidates) == 1:
        return candidates[0]
    if key in _measured:
        return _measured[key]
    if not measurable:
        return "torch"
    seconds: dict[str, float] = {}
    for name in candidates:
        try:
            seconds[name] = _median_seconds(lambda: run(name), device)
        except Exception as error:  # noqa: BLE001 (a kernel that fails on this call is not chosen; torch re-raises)
            if name == "torch":
                raise
            logger.info("FusedLinearCrossEntropy: backend %r failed its timing on %s (%s: %s); not used",
                        name, device.type, type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "")
    fastest = min(seconds, key=seconds.__getitem__)
    chosen = "torch" if seconds.get("torch", float("inf")) <= seconds[fastest] * (1 + TIE_MARGIN) else fastest
    _measured[key] = chosen
    logger.info("FusedLinearCrossEntropy: backend %r on %s for %s, the fastest measured (%s)", chosen, device.type,
                _describe_key(key), ", ".join(f"{name} {1e3 * t:.2f} ms" for name, t in sorted(seconds.items(),
                                                                                           key=lambda kv: kv[1])))
    return chosen


def measured_backends() -> dict[tuple[Any, ...], str]:
    """What `fastest_backend` chose in this process, by key (a copy)."""
    return dict(_measured)


def _median_seconds(call: Callable[[], None], device: torch.device) -> float:
    call()  # warm-up: compiles, autotunes
    times = []
    for _ in range(TIMED_CALLS):
        _synchronize(device)
        start = time.perf_counter()
        call()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _describe_key(key: tuple[Any, ...]) -> str:
    names = ("device", "dtype", "hidden", "vocab", "bias", "softcap", "tokens up to")
    return ", ".join(f"{name} {value}" for name, value in zip(names, key, strict=False))


def _why_not(name: str, device: torch.device, request: KernelRequest) -> str | None:
    if device.type != "cuda":
        return "it runs on CUDA only"
    if load_kernel(name) is None:
        return f"{KERNELS[name][0]} could not be imported (pip install remat[cuda-kernels])"
    return kernel_refusal(name, request)


def _announce(requested: str, device: torch.device, chosen: str, skipped: tuple[str, ...]) -> None:
    key = (requested, device.type, chosen, skipped)
    if key in _announced:
        return
    _announced.add(key)
    if requested not in ("auto", chosen):
        logger.warning("FusedLinearCrossEntropy: backend %r requested on %s but %s; using 'torch'",
                       requested, device.type, skipped[0].split(": ", 1)[1])
    elif skipped and device.type == "cuda":
        logger.info("FusedLinearCrossEntropy: backend %r on %s (requested 'auto'; skipped %s)",
                    chosen, device.type, "; ".join(skipped))
    else:
        logger.info("FusedLinearCrossEntropy: backend %r on %s (requested %r)", chosen, device.type, requested)


def kernel_arguments(name: str, hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
                     ignore_index: int, softcap: float | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments of kernel backend ``name``'s function for the summed loss."""
    if name == "cce":
        if bias is not None:
            raise ValueError("cut-cross-entropy takes no bias (select_backend never picks it for one)")
        # filter_eps=None: exact gradients (cce's default skips small softmax entries in backward)
        return (hidden, weight, targets), {"ignore_index": ignore_index, "softcap": softcap, "reduction": "sum",
                                           "filter_eps": None}
    return (hidden, weight, targets), {"bias": bias, "ignore_index": ignore_index, "reduction": "sum",
                                       "softcap": softcap}


def kernel_loss_sum(name: str, hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
                    ignore_index: int, softcap: float | None) -> Tensor:
    """Summed loss of the already-shifted flat ``targets`` computed by kernel backend ``name``."""
    kernel = load_kernel(name)
    if kernel is None:
        raise RuntimeError(f"loss backend {name!r} was selected but {KERNELS[name][0]} no longer imports")
    args, kwargs = kernel_arguments(name, hidden, weight, targets, bias, ignore_index, softcap)
    result = kernel(*args, **kwargs)
    return result[0] if isinstance(result, tuple) else result
