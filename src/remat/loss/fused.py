"""``FusedLinearCrossEntropy``: the next-token loss of ``hidden_states @ weight.T`` without the logits."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import ClassVar

import torch
from torch import Tensor

from remat.arguments import checked_keywords
from remat.errors import ConfigError
from remat.loss.backends import (
    KERNELS,
    Backend,
    KernelRequest,
    check_backend,
    fastest_backend,
    kernel_loss_sum,
    select_backend,
    usable_kernels,
)
from remat.loss.chunked import ChunkedLinearCrossEntropy, ChunkSettings, GradStrategy, plan_chunks
from remat.loss.contract import LossInput
from remat.loss.targets import (
    Reduction,
    check_labels,
    check_reduction,
    check_target_range,
    loss_divisor,
    next_token_targets,
)

GRAD_STRATEGIES: tuple[str, ...] = ("auto", "forward", "recompute")


class FusedLinearCrossEntropy:
    """Next-token cross-entropy of the output head applied to ``hidden_states``, never holding ``[tokens, vocab]``.

    Same label and reduction conventions as :class:`~remat.loss.MaskedCrossEntropy` (HF labels, shifted here;
    ``ignore_index`` tokens skipped; "mean" over label tokens or ``num_label_tokens``; "sum"), same value and
    gradients up to floating-point rounding. The math runs in fp32 for bf16/fp16/fp32 inputs.

    Args:
        ignore_index: label value of tokens that carry no loss (prompt, padding, document boundaries).
        reduction: "mean" or "sum".
        logit_softcap: Gemma-style cap: the logits are ``cap * tanh(logits / cap)``; None for no cap.
        chunk_size: tokens per chunk; None picks it from the vocabulary size and ``chunk_bytes``
            (see :func:`remat.loss.chunked.auto_token_chunk`).
        grad_strategy: "auto", "forward" (gradients computed in forward, 3 matmuls) or "recompute" (logits
            recomputed in backward, 4 matmuls, no fp32 weight-gradient accumulator); see :mod:`remat.loss.chunked`.
        chunk_bytes: working-memory target of one chunk, in bytes; None: 64 MiB eager, 256 MiB on the fast path.
        backend: "auto" (on CUDA, the fastest of "torch" and the kernel packages that import and can do the call,
            measured on the first call of each shape; see :func:`remat.loss.backends.fastest_backend`), "torch",
            "cce" or "liger".
        compile: the torch backend's fast path (chunk math compiled with ``torch.compile``, "forward" strategy,
            weight gradient accumulated in the weight's dtype); None: on CUDA tensors only.
    """

    consumes: ClassVar[LossInput] = "hidden_states"

    @checked_keywords
    def __init__(
        self,
        ignore_index: int = -100,
        reduction: Reduction = "mean",
        logit_softcap: float | None = None,
        chunk_size: int | None = None,
        *,
        grad_strategy: GradStrategy = "auto",
        chunk_bytes: int | None = None,
        backend: Backend = "auto",
        compile: bool | None = None,
    ) -> None:
        self.ignore_index = int(ignore_index)
        self.reduction: Reduction = check_reduction(reduction)
        if logit_softcap is not None and not (isinstance(logit_softcap, (int, float)) and 0 < logit_softcap < math.inf):
            raise ConfigError(f"loss_fn.logit_softcap: got {logit_softcap!r}; allowed: None or a positive number")
        self.logit_softcap = float(logit_softcap) if logit_softcap is not None else None
        if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size >= 1):
            raise ConfigError(f"loss_fn.chunk_size: got {chunk_size!r}; allowed: None (automatic) or an integer >= 1")
        self.chunk_size = chunk_size
        if grad_strategy not in GRAD_STRATEGIES:
            raise ConfigError(
                f"loss_fn.grad_strategy: got {grad_strategy!r}; allowed: {', '.join(map(repr, GRAD_STRATEGIES))}"
            )
        self.grad_strategy: GradStrategy = grad_strategy
        if chunk_bytes is not None and not (isinstance(chunk_bytes, int) and chunk_bytes >= 1):
            raise ConfigError(f"loss_fn.chunk_bytes: got {chunk_bytes!r}; allowed: None (automatic) or a positive "
                              "integer (bytes)")
        self.chunk_bytes = chunk_bytes
        self.backend: Backend = check_backend(backend)
        if compile is not None and not isinstance(compile, bool):
            raise ConfigError(f"loss_fn.compile: got {compile!r}; allowed: None (on CUDA), true or false")
        self.compile = compile

    def __repr__(self) -> str:
        return (
            f"FusedLinearCrossEntropy(ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"logit_softcap={self.logit_softcap}, chunk_size={self.chunk_size}, "
            f"grad_strategy={self.grad_strategy!r}, chunk_bytes={self.chunk_bytes}, backend={self.backend!r}, "
            f"compile={self.compile})"
        )

    def __call__(
        self,
        hidden_states: Tensor,
        lm_head_weight: Tensor,
        labels: Tensor,
        bias: Tensor | None = None,
        num_label_tokens: int | float | Tensor | None = None,
        *,
        shift: bool = True,
    ) -> Tensor:
        """Return the scalar loss (fp32; fp64 for fp64 inputs) of ``hidden_states [..., T, H]``, ``weight [V, H]``.

        ``lm_head_weight`` (and ``bias``) receive gradients like any autograd input: pass the parameter itself
        (a tied input embedding collects both gradients). A DTensor is gathered differentiably when it is replicated
        or lives on one rank; one sharded over several ranks is refused (see ``_gathered``): under FSDP2 call the
        loss inside the root module's forward, where the weight is already gathered. ``shift=False``: ``labels`` are
        already next-token targets, one per position (context parallelism's shards).
        """
        hidden, weight, bias, labels = _gathered(hidden_states, lm_head_weight, bias, labels)
        hidden, weight, bias = _autocast_cast(hidden, weight, bias)
        _check_inputs(hidden, weight, bias)
        check_labels(labels, hidden.shape[:-1], "hidden_states")
        vocab_size = weight.shape[0]
        targets = next_token_targets(labels.to(hidden.device), self.ignore_index, shift=shift)
        check_target_range(targets, vocab_size, self.ignore_index)
        rows = (targets != self.ignore_index).nonzero().squeeze(1)
        divisor = loss_divisor(self.reduction, rows.numel(), num_label_tokens)
        flat = hidden.reshape(-1, hidden.shape[-1])

        request = KernelRequest(flat.dtype, bias is not None, self.logit_softcap,
                                hidden.requires_grad and torch.is_grad_enabled())
        backend = self._backend(flat, weight, bias, targets, rows, request)
        if backend != "torch":
            total = kernel_loss_sum(backend, flat, weight, targets, bias, self.ignore_index, self.logit_softcap)
            return total.float() / divisor
        return self._torch_loss(flat, weight, bias, targets, rows, 1.0 / divisor)

    def _torch_loss(self, flat: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, rows: Tensor,
                    scale: float) -> Tensor:
        """remat's own chunked path (compiled on CUDA): ``scale`` times the summed loss of ``rows``."""
        plan = plan_chunks(flat.device, weight, rows.numel(), self.logit_softcap, self.grad_strategy, self.compile,
                           self.chunk_size, self.chunk_bytes)
        settings = ChunkSettings(
            scale=scale,
            softcap=self.logit_softcap,
            token_chunk=plan.token_chunk,
            strategy=plan.strategy,
            chunk_bytes=plan.chunk_bytes,
            grad_enabled=torch.is_grad_enabled(),
            fast=plan.fast,
        )
        with _autocast_off(flat.device):
            loss: Tensor = ChunkedLinearCrossEntropy.apply(flat, weight, bias, targets, rows, settings)
        return loss

    def _backend(self, flat: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, rows: Tensor,
                 request: KernelRequest) -> str:
        """The backend of this call: the one named, or under "auto" the fastest measured for this call's shape
        (NOTE [ The fused loss's backend is measured, not ranked ] in remat.loss.backends)."""
        if self.backend != "auto":
            return select_backend(self.backend, flat.device, request)
        usable, _ = usable_kernels(tuple(KERNELS), flat.device, request)
        if not usable:  # the CPU, or no kernel package that imports and can do the call
            return select_backend(self.backend, flat.device, request)
        cuda = flat.device.type == "cuda"
        tokens = 1 << max(int(rows.numel()) - 1, 0).bit_length()  # a power-of-two bucket: one timing per size class
        key = (torch.cuda.get_device_name(flat.device) if cuda else flat.device.type, str(flat.dtype).split(".")[-1],
               flat.shape[-1], weight.shape[0], bias is not None, self.logit_softcap, tokens)
        measurable = (request.hidden_needs_grad and not torch.compiler.is_compiling()
                      and not (cuda and torch.cuda.is_current_stream_capturing()))

        def run(name: str) -> None:
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in (flat, weight)]
            inputs.append(bias.detach().requires_grad_(bias.requires_grad) if bias is not None else None)
            with torch.enable_grad():
                if name == "torch":
                    loss = self._torch_loss(inputs[0], inputs[1], inputs[2], targets, rows, 1.0)
                else:
                    loss = kernel_loss_sum(name, inputs[0], inputs[1], targets, inputs[2], self.ignore_index,
                                           self.logit_softcap)
                differentiable = [t for t in inputs if t is not None and t.requires_grad]
                torch.autograd.grad(loss.float(), differentiable)

        return fastest_backend(key, [*usable, "torch"], run, flat.device, measurable=measurable)


def _gathered(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Replace DTensors by their full tensors, differentiably, where that is unambiguous.

    A DTensor sharded over several ranks is refused: whether the ranks' gradients must be summed (data parallel:
    every rank saw other tokens) or are already equal (tensor parallel: every rank saw the same tokens) depends on the
    layout, which the loss cannot see. Call the loss where the weight is gathered (inside the forward of the module
    ``fully_shard`` wraps, as ``remat.recipes.model_loss.CausalLMLoss`` does), or gather it yourself with
    ``weight.full_tensor(grad_placements=...)``.
    """
    if not torch.distributed.is_available():
        return tensors
    from torch.distributed.tensor import DTensor, Replicate

    gathered = []
    for t in tensors:
        if isinstance(t, DTensor):
            sharded = [p for p in t.placements if not isinstance(p, Replicate)]
            if sharded and t.device_mesh.size() > 1:
                raise ConfigError(
                    f"loss_fn: got a DTensor sharded as {list(t.placements)} over {t.device_mesh.size()} ranks; "
                    "allowed: a gathered weight (call the loss inside the forward of the module fully_shard wraps, "
                    "as remat's recipe does) or weight.full_tensor(grad_placements=...) with the placement that "
                    "matches your layout (Partial() when ranks see different tokens)"
                )
            t = t.full_tensor()
        gathered.append(t)
    return tuple(gathered)


def _autocast_cast(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Under autocast, cast the inputs to the autocast dtype as ``F.linear`` would (gradients flow back through)."""
    device_type = hidden.device.type
    if not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype) if bias is not None else None


@contextlib.contextmanager
def _autocast_off(device: torch.device) -> Iterator[None]:
    if torch.is_autocast_enabled(device.type):
        with torch.autocast(device.type, enabled=False):
            yield
    else:
        yield


def _check_inputs(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """Raise a ConfigError naming the argument whose shape, dtype or device does not fit the others."""
    if hidden.dim() < 2 or not hidden.dtype.is_floating_point:
        raise ConfigError(
            f"hidden_states: got shape {tuple(hidden.shape)} and dtype {hidden.dtype}; "
            "allowed: a floating tensor [..., sequence, hidden]"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ConfigError(
            f"lm_head_weight: got shape {tuple(weight.shape)}; allowed: [vocab, {hidden.shape[-1]}] "
            "(the output head's weight, hidden size matching hidden_states)"
        )
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ConfigError(f"bias: got shape {tuple(bias.shape)}; allowed: None or [{weight.shape[0]}] (vocab)")
    for name, tensor in (("lm_head_weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if tensor.dtype != hidden.dtype:
            raise ConfigError(
                f"{name}: got dtype {tensor.dtype}; allowed: the dtype of hidden_states ({hidden.dtype}); "
                "cast one of them or run under torch.autocast"
            )
        if tensor.device != hidden.device:
            raise ConfigError(f"{name}: got device {tensor.device}; allowed: the device of hidden_states "
                              f"({hidden.device})")
