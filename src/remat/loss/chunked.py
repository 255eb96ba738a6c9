"""The pure-PyTorch fused linear cross-entropy: an autograd.Function that never holds the ``[tokens, vocab]`` logits.

Only tokens whose target is not ignored are visited, a chunk of rows at a time. For each chunk the logits are
computed into one fp32 buffer that is then turned in place into the log-sum-exp, the softmax and finally the
gradient of the logits, so a chunk costs one ``[rows, vocab]`` fp32 buffer (two with a soft-cap, plus a
low-precision copy for the matmuls when the inputs are bf16/fp16).

Two ways to get the gradients (``grad_strategy``):

``"forward"``
    The gradients are computed in the forward pass, while each chunk's logits exist anyway, and kept until backward
    (which only multiplies them by the incoming gradient). Three matmuls in all, like the plain loss. The weight
    gradient is accumulated over the token chunks, directly in the output when the weight is fp32 and in an fp32
    ``[vocab, hidden]`` accumulator otherwise.
``"recompute"``
    The forward pass keeps the per-token log-sum-exp only; backward recomputes the logits a vocabulary slice at a
    time for all label tokens, writing each slice of the weight gradient once (no ``[vocab, hidden]`` accumulator).
    Four matmuls in all.

``"auto"`` takes ``"forward"`` unless that needs the fp32 weight-gradient accumulator (a bf16/fp16 weight that
requires grad and more than one token chunk), where the accumulator would cost more than the chunk itself.

The fast path (``ChunkSettings.fast``, the default on CUDA, see :func:`plan_chunks`) is the "forward" strategy with
the chunk math of :mod:`remat.loss.compiled` (one compiled kernel, the logit gradient written over the chunk's
low-precision logits), bigger chunks, and the weight gradient accumulated in the weight's own dtype by the matmul
(``addmm`` into the gradient buffer: fp32 sums inside each chunk's matmul, one rounding per token chunk, no fp32
``[vocab, hidden]`` accumulator). Three matmuls and one fused pass over each chunk's logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from remat.loss.compiled import CHUNK_MATH, compile_available

GradStrategy = Literal["auto", "forward", "recompute"]

#: Working-memory target of one chunk (its fp32 logits buffers plus low-precision copies), in bytes.
DEFAULT_CHUNK_BYTES = 64 * 2**20
#: The same on the fast path (CUDA): one ``[rows, vocab]`` buffer in the input dtype. 192 MiB is 768 rows of a 128k
#: vocabulary in bf16: matmuls of 768 rows keep a GPU's tensor cores busy, and the weight-gradient ``addmm`` reads and
#: writes its ``[vocab, hidden]`` output once per chunk, so fewer, bigger chunks cost less memory traffic; a bigger
#: budget would take the working memory at 16k tokens past 1.5x cut-cross-entropy's (its bf16 gradients, ~0.56 GiB).
FAST_CHUNK_BYTES = 192 * 2**20
#: Fewest rows (tokens) or vocabulary entries in a chunk, whatever the budget: a thin matmul wastes time (fp32
#: ``[rows, 2048] @ [2048, 32768]`` on the 2-core CPU here: 80 / 98 / 129 / 139 GFLOP/s at 128 / 256 / 512 / 1024
#: rows). 512 rows is also ~4% of the plain loss's three ``[tokens, vocab]`` fp32 tensors at 4096 tokens.
MIN_CHUNK = 512
#: Chunk sizes are rounded down to a multiple of this, for matmul-friendly shapes.
CHUNK_ALIGN = 64


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss math runs in: fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def bytes_per_logit(dtype: torch.dtype, softcap: float | None, fast: bool = False) -> int:
    """Peak working bytes per element of a chunk's logits.

    Eager: one accumulation-dtype buffer (logits, then softmax, then gradient), a second one while a soft-cap is
    applied (the derivative needs ``tanh`` and the softmax at once), and a low-precision copy of the gradient for the
    matmuls when the inputs are not in the accumulation dtype. Fast path: the logits buffer only (input dtype).
    """
    if fast:
        return dtype.itemsize
    acc = accumulation_dtype(dtype).itemsize
    low_precision_copy = dtype.itemsize if dtype != accumulation_dtype(dtype) else 0
    return max(acc + low_precision_copy, 2 * acc if softcap is not None else 0)


def _rows_for_budget(row_bytes: int, limit: int, chunk_bytes: int) -> int:
    rows = chunk_bytes // max(row_bytes, 1)
    rows = max(MIN_CHUNK, rows - rows % CHUNK_ALIGN)
    return max(1, min(rows, limit))


def auto_token_chunk(vocab_size: int, dtype: torch.dtype, softcap: float | None = None,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES, fast: bool = False) -> int:
    """Tokens per forward chunk: as many full-vocabulary rows as fit ``chunk_bytes``, at least ``MIN_CHUNK``."""
    return _rows_for_budget(vocab_size * bytes_per_logit(dtype, softcap, fast), 1 << 30, chunk_bytes)


def auto_vocab_chunk(num_tokens: int, vocab_size: int, dtype: torch.dtype, softcap: float | None = None,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Vocabulary entries per backward slice of the "recompute" strategy, for ``num_tokens`` label tokens."""
    return _rows_for_budget(num_tokens * bytes_per_logit(dtype, softcap), vocab_size, chunk_bytes)


def resolve_grad_strategy(strategy: GradStrategy, weight: Tensor, num_tokens: int, token_chunk: int,
                          fast: bool = False) -> str:
    """Turn ``"auto"`` into ``"forward"`` or ``"recompute"`` (see the module docstring for the rule)."""
    if strategy != "auto":
        return strategy
    if fast:
        return "forward"  # its accumulator is the gradient buffer itself
    needs_accumulator = weight.requires_grad and weight.dtype != accumulation_dtype(weight.dtype)
    return "recompute" if needs_accumulator and num_tokens > token_chunk else "forward"


@dataclass(frozen=True)
class ChunkSettings:
    """What the autograd function needs besides tensors."""

    scale: float
    softcap: float | None
    token_chunk: int
    strategy: str
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    grad_enabled: bool = True  # torch.is_grad_enabled() at the call (forward runs with grad mode off)
    fast: bool = False  # compiled chunk math, weight gradient accumulated in the weight's dtype ("forward" only)


@dataclass(frozen=True)
class ChunkPlan:
    """How the torch backend runs on a device: fast path or eager, chunk rows, gradient strategy."""

    fast: bool
    token_chunk: int
    strategy: str
    chunk_bytes: int


def plan_chunks(device: torch.device, weight: Tensor, num_tokens: int, softcap: float | None,
                strategy: GradStrategy, compile: bool | None, chunk_size: int | None,
                chunk_bytes: int | None) -> ChunkPlan:
    """Pick the path for ``device``: the fast path on CUDA (unless ``compile=False``), eager elsewhere.

    ``compile=True`` forces the fast path on any device (the CPU compiles it with a C++ compiler). The fast path runs
    the "forward" strategy; an explicit ``"recompute"`` runs eagerly wherever it is asked for.
    """
    wanted = device.type == "cuda" and compile_available(device) if compile is None else compile
    fast = wanted and strategy != "recompute"
    budget = chunk_bytes or (FAST_CHUNK_BYTES if fast else DEFAULT_CHUNK_BYTES)
    token_chunk = chunk_size or auto_token_chunk(weight.shape[0], weight.dtype, softcap, budget, fast)
    return ChunkPlan(fast, token_chunk, resolve_grad_strategy(strategy, weight, num_tokens, token_chunk, fast),
                     budget)


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, softcap: float | None) -> Tensor:
    """A fresh accumulation-dtype buffer of ``h @ weight.T + bias``, holding ``tanh(logits / softcap)`` if capped."""
    raw = torch.addmm(bias, h, weight.T) if bias is not None else h @ weight.T
    out = raw.to(accumulation_dtype(raw.dtype))
    del raw
    if softcap is not None:
        out.div_(softcap).tanh_()
    return out


def _capped(buf: Tensor, softcap: float | None) -> Tensor:
    """The (soft-capped) logits from ``_logits``' buffer: a new buffer if capped, the same one otherwise."""
    return buf * softcap if softcap is not None else buf


def _logit_grad_(buf: Tensor, probs: Tensor, hit_rows: Tensor, hit_cols: Tensor, softcap: float | None,
                 scale: float | Tensor) -> Tensor:
    """Gradient of the summed loss w.r.t. the raw logits, built in place: ``(softmax - onehot) * dcap * scale``."""
    minus_one = torch.full((hit_rows.numel(),), -1.0, dtype=probs.dtype, device=probs.device)
    probs.index_put_((hit_rows, hit_cols), minus_one, accumulate=True)
    grad = buf.square_().neg_().add_(1.0).mul_(probs) if softcap is not None else probs
    return grad.mul_(scale)


class _ForwardGrads:
    """Gradients accumulated chunk by chunk during the forward pass (the "forward" strategy)."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, needs: tuple[bool, ...],
                 in_weight_dtype: bool = False) -> None:
        acc = accumulation_dtype(weight.dtype)
        self.hidden = torch.zeros_like(hidden) if needs[0] else None
        self.weight = torch.zeros_like(weight, dtype=weight.dtype if in_weight_dtype else acc) if needs[1] else None
        self.bias = torch.zeros_like(bias, dtype=acc) if bias is not None and needs[2] else None
        self.dtype = weight.dtype  # hidden, weight and bias share it (checked by the caller)

    def add_chunk(self, rows: Tensor, h: Tensor, grad: Tensor, weight: Tensor) -> None:
        """Add one chunk's contribution given its logit gradient ``grad [rows, vocab]`` (fp32 or the input dtype)."""
        if self.bias is not None:
            self.bias.add_(grad.sum(0, dtype=self.bias.dtype))
        if self.hidden is not None:
            self.hidden.index_copy_(0, rows, grad.to(weight.dtype) @ weight)
        if self.weight is not None:
            g = grad.to(self.weight.dtype)
            torch.addmm(self.weight, g.T, h.to(g.dtype), out=self.weight)  # in place, seen as a matmul

    def scaled(self, grad_loss: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """The final gradients times the incoming gradient of the loss, in the inputs' dtypes."""
        out = []
        for grad in (self.hidden, self.weight, self.bias):
            if grad is not None:
                grad = grad.mul_(grad_loss).to(self.dtype)
            out.append(grad)
        return out[0], out[1], out[2]


def _backward_slice(h: Tensor, t: Tensor, lse: Tensor, weight: Tensor, bias: Tensor | None, part: slice,
                    softcap: float | None, scale: Tensor, d_h: Tensor | None, d_weight: Tensor | None,
                    d_bias: Tensor | None) -> None:
    """Add the gradients of one vocabulary slice ``part`` (all label tokens ``h``, targets ``t``) to the outputs.

    A function of its own so that the slice's buffers die before the next slice allocates its own.
    """
    w = weight[part]
    buf = _logits(h, w, bias[part] if bias is not None else None, softcap)
    probs = _capped(buf, softcap).sub_(lse[:, None]).exp_()
    hit_rows = ((t >= part.start) & (t < part.stop)).nonzero().squeeze(1)
    grad = _logit_grad_(buf, probs, hit_rows, t.index_select(0, hit_rows) - part.start, softcap, scale)
    del probs, buf
    if d_bias is not None:
        d_bias[part] = grad.sum(0)
    grad_in = grad.to(weight.dtype)
    del grad
    if d_h is not None:
        d_h.add_(grad_in @ w)
    if d_weight is not None:
        torch.mm(grad_in.T, h, out=d_weight[part])


def _recomputed_grads(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, rows: Tensor,
                      lse: Tensor, settings: ChunkSettings, needs: tuple[bool, ...], grad_loss: Tensor,
                      ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The "recompute" backward: vocabulary slices over all label tokens, each weight-gradient slice written once."""
    d_hidden = torch.zeros_like(hidden) if needs[0] else None
    d_bias = torch.zeros_like(bias) if bias is not None and needs[2] else None
    if rows.numel() == 0:
        return d_hidden, torch.zeros_like(weight) if needs[1] else None, d_bias
    d_weight = torch.empty_like(weight) if needs[1] else None  # every vocabulary slice is written once
    h = hidden.index_select(0, rows)
    t = targets.index_select(0, rows)
    acc = accumulation_dtype(weight.dtype)
    d_h = torch.zeros(h.shape, dtype=acc, device=h.device) if d_hidden is not None else None
    scale = grad_loss.to(acc) * settings.scale
    vocab = weight.shape[0]
    step = auto_vocab_chunk(rows.numel(), vocab, weight.dtype, settings.softcap, settings.chunk_bytes)
    for v0 in range(0, vocab, step):
        _backward_slice(h, t, lse, weight, bias, slice(v0, min(v0 + step, vocab)), settings.softcap, scale,
                        d_h, d_weight, d_bias)
    if d_hidden is not None and d_h is not None:
        d_hidden.index_copy_(0, rows, d_h.to(hidden.dtype))
    return d_hidden, d_weight, d_bias


def _forward_chunk(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_rows: Tensor,
                   settings: ChunkSettings, grads: _ForwardGrads | None) -> tuple[Tensor, Tensor]:
    """Log-sum-exp and summed loss of the rows ``chunk_rows``; adds their gradients to ``grads`` if given.

    A function of its own so that the chunk's buffers die before the next chunk allocates its own.
    """
    h = hidden.index_select(0, chunk_rows)
    t = targets.index_select(0, chunk_rows)
    if settings.fast:
        return _fast_chunk(h, t, weight, bias, chunk_rows, settings, grads)
    buf = _logits(h, weight, bias, settings.softcap)
    z = _capped(buf, settings.softcap)
    target_logit = z.gather(1, t[:, None]).squeeze(1)
    row_max = z.amax(1, keepdim=True)
    exp = z.sub_(row_max).exp_()
    denom = exp.sum(1, keepdim=True)
    lse = denom.log().add_(row_max).squeeze(1)
    loss_sum = (lse - target_logit).sum()
    if grads is not None:
        probs = exp.div_(denom)
        del z, exp
        local_rows = torch.arange(chunk_rows.numel(), device=t.device)
        grad = _logit_grad_(buf, probs, local_rows, t, settings.softcap, settings.scale)
        del probs, buf
        grads.add_chunk(chunk_rows, h, grad, weight)
    return lse, loss_sum


def _fast_chunk(h: Tensor, t: Tensor, weight: Tensor, bias: Tensor | None, chunk_rows: Tensor,
                settings: ChunkSettings, grads: _ForwardGrads | None) -> tuple[Tensor, Tensor]:
    """The fast path's chunk: logits in the input dtype, one compiled pass turns them into their gradient."""
    logits = torch.addmm(bias, h, weight.T) if bias is not None else h @ weight.T
    scale = torch.full((), settings.scale, dtype=accumulation_dtype(logits.dtype), device=logits.device)
    lse, losses = CHUNK_MATH(logits, t, scale, settings.softcap)
    if grads is not None:
        grads.add_chunk(chunk_rows, h, logits, weight)
    return lse, losses.sum()


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum over label rows of (logsumexp(z_i) - z_i[target_i]) * scale`` with ``z = cap(hidden @ weight.T + bias)``.

    Inputs: ``hidden [N, H]``, ``weight [V, H]``, ``bias [V] | None``, ``targets [N]`` (int64, already shifted),
    ``rows`` (int64 indices of the rows whose target is not ignored) and a :class:`ChunkSettings`.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, rows: Tensor,
                settings: ChunkSettings) -> Tensor:
        needs = tuple(settings.grad_enabled and needed for needed in ctx.needs_input_grad[:3])
        wants_grad = any(needs)
        forward = wants_grad and settings.strategy == "forward"
        grads = _ForwardGrads(hidden, weight, bias, needs, settings.fast) if forward else None
        keep_lse = wants_grad and settings.strategy == "recompute"
        acc = accumulation_dtype(weight.dtype)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        lse_all = torch.empty(rows.numel(), dtype=acc, device=hidden.device) if keep_lse else None
        for start in range(0, rows.numel(), settings.token_chunk):
            chunk_rows = rows[start:start + settings.token_chunk]
            lse, loss_sum = _forward_chunk(hidden, weight, bias, targets, chunk_rows, settings, grads)
            total += loss_sum
            if lse_all is not None:
                lse_all[start:start + chunk_rows.numel()] = lse
        ctx.settings = settings
        ctx.needs = needs
        ctx.grads = grads
        if keep_lse:
            ctx.save_for_backward(hidden, weight, bias, targets, rows, lse_all)
        return total * settings.scale

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        none = (None, None, None)
        if ctx.settings.strategy == "forward":
            grads: _ForwardGrads | None = ctx.grads
            ctx.grads = None  # hand the buffers over, so autograd can adopt them as .grad without a copy
            if grads is None:
                raise RuntimeError(
                    "FusedLinearCrossEntropy(grad_strategy='forward') computes its gradients once, in the forward "
                    "pass: backward through it can run only once (use grad_strategy='recompute' for retain_graph)"
                )
            return (*grads.scaled(grad_loss), *none)
        hidden, weight, bias, targets, rows, lse = ctx.saved_tensors
        return (*_recomputed_grads(hidden, weight, bias, targets, rows, lse, ctx.settings, ctx.needs, grad_loss),
                *none)
