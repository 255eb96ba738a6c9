"""Scaled-dot-product attention as a CUDA GPU runs it, simulated on fake CPU tensors.

On the CPU, ``F.scaled_dot_product_attention`` runs ``aten._scaled_dot_product_flash_attention_for_cpu`` for any
dtype, with or without a mask: it keeps the output and a ``[batch, heads, seq]`` fp32 log-sum-exp for backward and
never holds a ``seq x seq`` matrix. A CUDA GPU picks another kernel, keeps other tensors for backward and allocates
workspaces inside its backward kernel, so a simulation on the CPU must not simply run the CPU kernel.
Inside `CudaAttention`, ``torch.nn.functional.scaled_dot_product_attention`` is replaced by a function that runs the
kernel PyTorch would pick on an Ampere/Hopper GPU, with its own autograd formula, called on the fake tensors through
its meta implementation. (The replacement is a module attribute, not a ``TorchFunctionMode``: function modes are not
active while autograd recomputes checkpointed blocks, and the recompute must call the same kernel. Code that bound
the function under another name before the simulation started keeps the CPU kernel, ``CPU_ATTENTION_OP``, which the
simulation counts.)

- ``flash`` (``aten._scaled_dot_product_flash_attention``): fp16/bf16, no mask, equal head dims <= 256 (grouped
  KV heads natively). Keeps the output, a ``[batch, heads, seq]`` fp32 log-sum-exp and a 16-byte RNG state. Head
  dims that are not a multiple of 8 are padded first, as ATen does.
- ``efficient`` (``aten._scaled_dot_product_efficient_attention``): when flash cannot run (an ``attn_mask``, fp32
  inputs), the head dims are aligned (8 elements for fp16/bf16, 4 for fp32) and query and key have as many heads
  (PyTorch 2.13's memory-efficient kernel has no grouped-KV support; transformers repeats the KV heads itself
  whenever it passes a mask). The additive mask is kept for
  backward (padded to a multiple of 16 keys when its strides are not aligned, as ATen does).
- ``math`` (``aten._scaled_dot_product_attention_math``): otherwise. Materialises the ``[batch, heads, q, k]``
  scores and softmax (fp32: on CUDA, fp16/bf16 inputs are upcast first unless
  ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``), exactly as the math kernel does.

Before any kernel, a boolean mask becomes an additive mask of the query's dtype (``[batch, 1, q, k]``: one byte per
element becomes two or four), as ATen does for every kernel but cuDNN's.

`backward_workspace` gives what the CUDA backward kernels allocate inside themselves; the simulation allocates it
around the op, above the live-tensor tracker, so that the tracker sees it in the peak:

- flash backward (FlashAttention-2 ``mha_bwd``): ``softmax_d`` ``[batch, heads, round128(seq_q)]`` fp32, the dQ
  accumulator ``[batch, round128(seq_q), heads, round32(head_dim)]`` fp32 (``round64`` above 128), and, with grouped KV
  heads, dK and dV expanded to all query heads (``[batch, seq_k, heads, head_dim]`` each, in the input dtype);
- efficient backward (CUTLASS kernel): ``delta`` ``[batch, heads, seq_q]`` fp32 and, for fp16/bf16 inputs, the fp32
  dQ accumulator ``[batch, heads, round64(seq_q), round64(head_dim)]``, an upper bound of the kernel's
  ``workspace_size()`` (its exact tile shapes depend on the GPU generation);
- softmax backward (``_softmax_backward_data``, the math and eager paths): ``grad * output``, the gradient's size.

Kernel choice follows PyTorch 2.8-2.13 with default settings (priority flash, efficient, math); cuDNN attention,
which recent PyTorch versions prefer on some Hopper/Blackwell setups with a new cuDNN, is not modelled.
Not modelled either: the efficient kernel's log-sum-exp padding to a multiple of 32 queries (less than
``batch x heads x 124`` bytes per call).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final, Literal

import torch
import torch.nn.functional as F

CudaAttentionKernel = Literal["flash", "efficient", "math"]
CUDA_ATTENTION_KERNELS: Final[tuple[str, ...]] = ("flash", "efficient", "math")

_HALF = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
_aten = torch.ops.aten


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def cuda_attention_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
) -> CudaAttentionKernel:
    """The kernel ``F.scaled_dot_product_attention`` uses on an sm80+ GPU for these (already autocast) inputs."""
    half = query.dtype in _HALF
    d_q, d_k, d_v = query.shape[-1], key.shape[-1], value.shape[-1]
    grouped = query.shape[-3] != key.shape[-3]
    if grouped and not enable_gqa:
        return "math"  # ATen rejects different head counts without enable_gqa in every fused kernel
    if attn_mask is None and half and d_q == d_k == d_v and d_q <= _FLASH_MAX_HEAD_DIM:
        return "flash"
    alignment = 8 if half else 4
    if (not grouped and query.dtype in (*_HALF, torch.float32) and d_q == d_k and d_q % alignment == 0
            and d_v % alignment == 0):
        return "efficient"
    return "math"


class CudaAttention:
    """While entered, ``F.scaled_dot_product_attention`` runs the CUDA kernel's op (see the module docstring).

    The flash and efficient kernels' calls are counted where their ops run (`KERNEL_OPS`, in the simulation's
    dispatch mode), recomputations included: a compiled block runs this function once, while dynamo traces it, and
    a count kept here would be a side effect dynamo cannot keep inside a checkpointed region. The math kernel's op
    is a composite that reaches no dispatch mode, so its eager calls are counted here (``math_calls``).
    Not re-entrant, and not thread-safe: the replacement is process-wide while entered.
    """

    def __init__(self) -> None:
        self._original: Callable[..., torch.Tensor] | None = None
        self.math_calls = 0

    def __enter__(self) -> CudaAttention:
        if self._original is not None:
            raise RuntimeError("CudaAttention is already active")
        self._original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._attention  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        F.scaled_dot_product_attention = self._original  # type: ignore[assignment]
        self._original = None

    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        query, key, value, attn_mask = _autocast_inputs(query, key, value, attn_mask)
        kernel = cuda_attention_kernel(query, key, value, attn_mask, enable_gqa)
        if kernel == "math" and not torch.compiler.is_compiling():
            self.math_calls += 1
        if scale is None:
            scale = 1.0 / math.sqrt(query.shape[-1])
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # ATen does this for every kernel but cuDNN
            attn_mask = torch.where(attn_mask.logical_not(), -math.inf, torch.zeros((), dtype=query.dtype))
        if kernel == "flash":
            return _flash(query, key, value, dropout_p, is_causal, scale)
        if kernel == "efficient":
            return _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale)
        return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _autocast_inputs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Autocast lists SDPA as a lower-precision op on CUDA: floating inputs are cast before the kernel is chosen.

    The kernel ops called below are not in autocast's lists, so the cast made by autocast for SDPA is repeated here.
    """
    device = query.device.type
    if not torch.is_autocast_enabled(device):
        return query, key, value, attn_mask
    dtype = torch.get_autocast_dtype(device)

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != dtype else t

    return cast(query), cast(key), cast(value), cast(attn_mask)  # type: ignore[return-value]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, is_causal: bool,
           scale: float) -> torch.Tensor:
    head_dim = q.shape[-1]
    pad = _round_up(head_dim, 8) - head_dim
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    out = _aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    return out[..., :head_dim] if pad else out


def _efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
               dropout_p: float, is_causal: bool, scale: float) -> torch.Tensor:
    bias = None
    if attn_mask is not None:
        bias = _aligned_bias(attn_mask).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    compute_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return _aten._scaled_dot_product_efficient_attention(q, k, v, bias, compute_lse, dropout_p, is_causal,
                                                         scale=scale)[0]


def _aligned_bias(bias: torch.Tensor, alignment: int = 16) -> torch.Tensor:
    """ATen pads the additive mask's last dim to a multiple of 16 elements unless its strides already align."""
    if all(stride % alignment == 0 for stride in bias.stride()[:-1]):
        return bias
    last = bias.shape[-1]
    return F.pad(bias, (0, alignment - last % alignment))[..., :last]


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, dropout_p: float,
          is_causal: bool, scale: float, enable_gqa: bool) -> torch.Tensor:
    dtype = q.dtype
    if dtype in _HALF and not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        q, k, v = q.float(), k.float(), v.float()
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.float()
    out = _aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale,
                                                   enable_gqa=enable_gqa)[0]
    return out.to(dtype)


# ------------------------------------------------------------------------------------------------ backward workspaces

def _flash_backward_workspace(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """What FlashAttention-2's ``mha_bwd`` allocates besides dQ, dK, dV (inputs are ``[batch, heads, seq, dim]``)."""
    query, key = args[1], args[2]
    batch, heads, seq_q, head_dim = query.shape
    seq_k = key.shape[2]
    f32 = {"dtype": torch.float32, "device": query.device}
    seq_q_rounded = _round_up(seq_q, 128)
    head_dim_rounded = _round_up(head_dim, 32 if head_dim <= 128 else 64)
    workspace = [
        torch.empty(batch, heads, seq_q_rounded, **f32),  # softmax_d
        torch.empty(batch, seq_q_rounded, heads, head_dim_rounded, **f32),  # dq_accum
    ]
    if key.shape[1] != heads:  # grouped KV heads: dK, dV for every query head, summed afterwards
        workspace += [torch.empty(batch, seq_k, heads, head_dim, dtype=query.dtype, device=query.device)
                      for _ in range(2)]
    return workspace


def _efficient_backward_workspace(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """What the CUTLASS memory-efficient backward allocates besides dQ, dK, dV (``delta`` and its dQ accumulator)."""
    query = args[1]
    batch, heads, seq_q, head_dim = query.shape
    f32 = {"dtype": torch.float32, "device": query.device}
    workspace = [torch.empty(batch, heads, seq_q, **f32)]
    if query.dtype in _HALF:
        workspace.append(torch.empty(batch, heads, _round_up(seq_q, 64), _round_up(head_dim, 64), **f32))
    return workspace


def _softmax_backward_workspace(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """CUDA's softmax backward (``softmax_backward_cuda_out``) first computes ``grad * output`` into a temporary of
    the gradient's size and reduces that: for the math and eager attention paths, one more ``[batch, heads, q, k]``
    tensor while the kernel runs (seen on an H200, torch 2.11: 128 MiB at 4 x 1024 tokens, 8 heads, fp32)."""
    grad, output = args[0], args[1]
    return [torch.empty(grad.shape, dtype=torch.result_type(grad, output), device=grad.device)]


_WORKSPACES: Final[dict[Any, Callable[[tuple[Any, ...]], list[torch.Tensor]]]] = {
    _aten._scaled_dot_product_flash_attention_backward.default: _flash_backward_workspace,
    _aten._scaled_dot_product_efficient_attention_backward.default: _efficient_backward_workspace,
    _aten._softmax_backward_data.default: _softmax_backward_workspace,
}


CPU_ATTENTION_OP: Final[Any] = _aten._scaled_dot_product_flash_attention_for_cpu.default

KERNEL_OPS: Final[dict[Any, str]] = {
    _aten._scaled_dot_product_flash_attention.default: "flash",
    _aten._scaled_dot_product_efficient_attention.default: "efficient",
}
"""The op the flash and efficient kernels run as (`CudaAttention`): each dispatch is a forward call of that kernel,
recomputations included."""
"""The CPU kernel: seeing it while modelling CUDA means a call bypassed `CudaAttention`."""


def backward_workspace(func: Any, args: tuple[Any, ...]) -> list[torch.Tensor] | None:
    """The tensors a CUDA backward kernel (attention's, softmax's) allocates inside itself for this op call (None for
    other ops).

    Create them right before running the op and drop them right after, inside a live-tensor tracker, so that the
    tracker counts them while the kernel runs.
    """
    make_workspace = _WORKSPACES.get(func)
    return make_workspace(args) if make_workspace is not None else None
