"""Gradient-norm clipping that is correct for sharded parameters.

``torch.nn.utils.clip_grad_norm_`` works on DTensor gradients as long as they all live on one device mesh. Under
FSDP2 combined with tensor parallelism they do not (sharded-only parameters live on the data-parallel mesh,
tensor-parallel ones on the 2-D mesh), so the norm is taken per mesh with ``torch.nn.utils.get_total_norm``, each
partial norm is made whole with ``full_tensor()`` (torch's collective), and the parts are combined. Plain tensors
(single process, DDP after its all-reduce, replicated tensor-parallel parameters) hold the full gradient already.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor


def _mesh_key(tensor: Tensor) -> object:
    """Gradients that can be reduced together: the same DTensor mesh (or plain tensors), device and dtype."""
    mesh = getattr(tensor, "device_mesh", None)
    return (id(mesh) if mesh is not None else None, tensor.device, tensor.dtype)


def total_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The norm of all gradients of ``parameters`` taken together, as a plain fp32 tensor (same value on every rank)
    on the gradients' device: nothing waits for the device here, so a guard can test it on the device."""
    groups: dict[object, list[Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            groups.setdefault(_mesh_key(param.grad), []).append(param.grad)
    parts: list[Tensor] = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
        full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        parts.append(full.detach().float())
    if len(parts) <= 1:
        return parts[0] if parts else torch.zeros(())
    stacked = torch.stack([part.to(parts[0].device) for part in parts])
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float | None, norm_type: float = 2.0) -> float:
    """Scale the gradients so that their total norm is at most ``max_norm`` (None: only measure); returns the norm
    before clipping."""
    return float(clip_grad_norm_tensor(parameters, max_norm, norm_type))


def clip_grad_norm_tensor(parameters: Iterable[Tensor], max_norm: float | None, norm_type: float = 2.0) -> Tensor:
    """`clip_grad_norm` returning the norm as a tensor: no host synchronisation, so it also runs on fake tensors
    (the memory estimate simulates the training step with it)."""
    params = [p for p in parameters if p.grad is not None]
    total = total_grad_norm(params, norm_type)
    if max_norm is not None and params:
        by_mesh: dict[object, list[Tensor]] = {}
        for param in params:
            by_mesh.setdefault(_mesh_key(param.grad), []).append(param)
        for group in by_mesh.values():
            device_total = total.to(group[0].grad.device)
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, device_total)
    return total
