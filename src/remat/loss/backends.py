"""Optional CUDA kernels behind ``FusedLinearCrossEntropy(backend=...)``: cut-cross-entropy and liger-kernel.

Neither is a dependency (``pip install remat[cuda-kernels]``). They run only on CUDA tensors; everywhere else, and
whenever the package cannot be imported, the pure-PyTorch implementation runs instead. The choice is logged once
per (requested backend, device type, outcome).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Literal, get_args

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

_announced: set[tuple[str, str, str]] = set()


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


def select_backend(requested: Backend, device: torch.device) -> str:
    """The backend that will run: a requested kernel on CUDA if it imports, "auto" tries cce then liger, else torch."""
    if requested == "torch":
        return "torch"
    candidates = tuple(KERNELS) if requested == "auto" else (requested,)
    chosen = "torch"
    if device.type == "cuda":
        chosen = next((name for name in candidates if load_kernel(name) is not None), "torch")
    _announce(requested, device, chosen)
    return chosen


def _announce(requested: str, device: torch.device, chosen: str) -> None:
    key = (requested, device.type, chosen)
    if key in _announced:
        return
    _announced.add(key)
    if requested not in ("auto", chosen):
        why = "it runs on CUDA only" if device.type != "cuda" else f"{KERNELS[requested][0]} could not be imported"
        logger.warning("FusedLinearCrossEntropy: backend %r requested on %s but %s; using 'torch'",
                       requested, device.type, why)
    else:
        logger.info("FusedLinearCrossEntropy: backend %r on %s (requested %r)", chosen, device.type, requested)


def kernel_loss_sum(name: str, hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None,
                    ignore_index: int, softcap: float | None) -> Tensor:
    """Summed loss of the already-shifted flat ``targets`` computed by kernel backend ``name``."""
    kernel = load_kernel(name)
    if kernel is None:
        raise RuntimeError(f"loss backend {name!r} was selected but {KERNELS[name][0]} no longer imports")
    if name == "cce":
        # filter_eps=None: exact gradients (cce's default skips small softmax entries in backward)
        return kernel(hidden, weight, targets, bias=bias, ignore_index=ignore_index, softcap=softcap,
                      reduction="sum", filter_eps=None)
    result = kernel(hidden, weight, targets, bias=bias, ignore_index=ignore_index, softcap=softcap,
                    reduction="sum")
    return result[0] if isinstance(result, tuple) else result
