"""The fast path's chunk math: a chunk's log-sum-exp, loss and logit gradient in one ``torch.compile``d function.

On a GPU the pure-PyTorch loss is limited by memory traffic, not by its matmuls: the eager chunk math
(:mod:`remat.loss.chunked`) makes about ten passes over an fp32 copy of the chunk's logits. Here the whole chunk math
is one function that Inductor fuses into one or two kernels: they read the chunk's low-precision logits (twice at
most: max and sum, then the gradient), compute in fp32 in registers and write the gradient of the logits back
*into the logits buffer*, so a chunk costs one ``[rows, vocab]`` tensor in the input dtype and nothing else.

The gradient is written in the logits' dtype (bf16 for bf16 inputs), which is what the two gradient matmuls take as
their input anyway. If ``torch.compile`` is unavailable or fails, the same function runs eagerly (with fp32
temporaries; a warning says so once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

logger = logging.getLogger("remat.loss")

LseAndGrad = Callable[[Tensor, Tensor, Tensor, "float | None"], Tensor]


def softmax_xent_grad_(logits: Tensor, targets: Tensor, scale: Tensor,
                       softcap: float | None) -> tuple[Tensor, Tensor]:
    """Per-row log-sum-exp and loss of ``logits [rows, vocab]`` (soft-capped if ``softcap``), in fp32 (fp64 for fp64).

    Overwrites ``logits`` with ``d(scale * sum(loss)) / d(raw logits)`` = ``(softmax - onehot) * dcap * scale``.
    ``scale`` is a 0-dim tensor (a Python float would make ``torch.compile`` recompile for every new value).
    """
    target = target_logits(logits, targets, softcap)
    lse = lse_and_grad_(logits, targets, scale, softcap)
    return lse, lse - target


def target_logits(logits: Tensor, targets: Tensor, softcap: float | None) -> Tensor:
    """The (soft-capped) logit of each row's target, in fp32 (fp64 for fp64): ``[rows]``.

    Read *before* `lse_and_grad_` overwrites ``logits``, and outside the compiled function: torch 2.11's Inductor
    (CPU, measured) ordered a gather from the logits after their in-place overwrite inside one compiled graph, giving
    losses off by several nats while the log-sum-exp and the gradient were right."""
    raw = logits.gather(1, targets[:, None]).squeeze(1).to(torch.promote_types(logits.dtype, torch.float32))
    return torch.tanh(raw / softcap) * softcap if softcap is not None else raw


def lse_and_grad_(logits: Tensor, targets: Tensor, scale: Tensor, softcap: float | None) -> Tensor:
    """The per-row log-sum-exp of the (soft-capped) logits; overwrites ``logits`` with the gradient (see
    `softmax_xent_grad_`). This is the part that is compiled."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        capped = torch.tanh(x / softcap)
        z = capped * softcap
    else:
        z = x
    row_max = z.amax(1, keepdim=True)
    lse = torch.log(torch.exp(z - row_max).sum(1, keepdim=True)) + row_max
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == targets[:, None]
    # exp recomputed from lse rather than reused: a reused exp would be stored as an fp32 [rows, vocab] buffer
    grad = torch.exp(z - lse) - onehot.to(z.dtype)
    if softcap is not None:
        grad = grad * (1.0 - capped * capped)
    logits.copy_(grad * scale)
    return lse.squeeze(1)


def compile_available(device: torch.device) -> bool:
    """Whether ``torch.compile`` can compile for ``device``: Dynamo supports this Python, and Triton is there for a GPU."""
    if not torch._dynamo.is_dynamo_supported():
        return False
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return bool(has_triton())
    return True


class CompiledChunkMath:
    """:func:`softmax_xent_grad_` with its :func:`lse_and_grad_` through ``torch.compile`` (compiled on first use,
    eager after a failed compile); the target logits are gathered eagerly first (see `target_logits`).

    ``compiler`` is ``torch.compile`` (tests pass another one, e.g. the identity, to run this path quickly).
    """

    def __init__(self, compiler: Callable[[LseAndGrad], LseAndGrad] | None = None) -> None:
        self._compiler = compiler
        self._compiled: LseAndGrad | None = None
        self.failed: str | None = None  # why compiling failed, once it has

    def _function(self) -> LseAndGrad:
        if self._compiled is None:
            compiler = self._compiler or (lambda fn: torch.compile(fn, dynamic=None))
            self._compiled = compiler(lse_and_grad_)
        return self._compiled

    def __call__(self, logits: Tensor, targets: Tensor, scale: Tensor,
                 softcap: float | None) -> tuple[Tensor, Tensor]:
        target = target_logits(logits, targets, softcap)
        if is_fake(logits):
            # remat's memory estimate simulates the step on fake tensors: allocate what the compiled kernel
            # allocates (per-row outputs; the gradient goes into the logits buffer) and never compile
            lse = logits.new_empty(logits.shape[0], dtype=target.dtype)
        elif self.failed is not None or torch.compiler.is_compiling():
            # an outer torch.compile traces the plain function itself
            lse = lse_and_grad_(logits, targets, scale, softcap)
        else:
            lse = self._compiled_lse_and_grad(logits, targets, scale, softcap)
        return lse, lse - target

    def _compiled_lse_and_grad(self, logits: Tensor, targets: Tensor, scale: Tensor, softcap: float | None) -> Tensor:
        try:
            return self._function()(logits, targets, scale, softcap)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # no triton, no C++ compiler, an Inductor bug: the math still runs, eagerly
            self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            logger.warning("FusedLinearCrossEntropy: torch.compile of the chunk math failed (%s); running it "
                           "eagerly, which is slower and holds fp32 temporaries of the chunk", self.failed)
            return lse_and_grad_(logits, targets, scale, softcap)


#: The process-wide compiled chunk math (one compile cache for every FusedLinearCrossEntropy).
CHUNK_MATH = CompiledChunkMath()
