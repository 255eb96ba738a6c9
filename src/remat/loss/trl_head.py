"""`TRLFusedLMHead`: the loss TRL's ``SFTTrainer`` trains with, as a remat loss, so that ``auto`` plans TRL's step.

TRL (from 1.x) replaces the model's forward with its own "fused LM head" (``trl.trainer.utils.add_fused_lm_head``):
the trainer calls ``model(..., fused_lm_head=True)`` and gets per-token log-probabilities (and, for its metrics,
entropy and whether the label is the top-1 token), computed in vocabulary tiles by its own autograd function. Its
memory is not a plain or a fused cross-entropy's: it keeps a ``[tokens, 32768]`` tile buffer whatever the vocabulary,
accumulates the head's gradients in float32, and on a GPU scores only the labelled positions.

# NOTE [ TRL's own code, not a model of it ]
# The planned step must hold what TRL's step holds, in every TRL version remat supports. So this loss does not
# restate TRL's arithmetic: it hands the decoder's last hidden states to TRL's own patched forward, installed by
# TRL's public ``add_fused_lm_head`` on a stand-in model whose backbone returns those hidden states and whose output
# embeddings are the real head's weight and bias. Everything after the backbone (the shift, the mask, the tiled
# function, its saved tensors, the reduction) is TRL's code running on the simulation's tensors. On a GPU TRL folds
# its tiles with Triton kernels, which allocate nothing (they update TRL's own buffers in place) and cannot run on
# fake tensors; ``device_kernels=True`` (what the estimate asks for a CUDA target) runs TRL's GPU path with those
# kernels stubbed out, and is refused on real tensors.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from remat.arguments import checked_keywords
from remat.errors import ConfigError
from remat.loss.contract import LossInput

#: The per-token outputs TRL's fused LM head can compute (``add_fused_lm_head(outputs=...)``).
TRL_OUTPUTS: tuple[str, ...] = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
#: What ``SFTTrainer`` asks of it (its loss and its ``entropy`` / ``mean_token_accuracy`` metrics).
SFT_OUTPUTS: tuple[str, ...] = ("log_probs", "entropy", "is_top1")


class TRLFusedLMHead:
    """The next-token loss of TRL's fused LM head (``SFTTrainer``'s training loss): ``-sum(log p(label)) / n`` over
    the labelled tokens (``n`` = ``num_label_tokens`` when given), computed by TRL's own code (NOTE above).

    Args:
        outputs: the per-token fields TRL computes besides ``log_probs`` (each costs memory): SFTTrainer's
            ``("log_probs", "entropy", "is_top1")`` by default.
        temperature: what TRL divides the logits by (1.0 in SFT).
        logit_softcap, logit_scale: the model config's ``final_logit_softcapping`` and logit multiplier, as TRL reads
            them from the config.
        cast_lm_head_to_fp32: TRL's option of the same name (the head in float32, outside autocast).
        device_kernels: run TRL's GPU path (only the labelled positions, Triton folds) with its kernels stubbed out:
            for an estimate of a CUDA step on fake tensors; refused on real tensors.
    """

    consumes: ClassVar[LossInput] = "hidden_states"
    ignore_index: ClassVar[int] = -100

    @checked_keywords
    def __init__(self, outputs: tuple[str, ...] | list[str] = SFT_OUTPUTS, temperature: float = 1.0,
                 logit_softcap: float | None = None, logit_scale: float = 1.0, cast_lm_head_to_fp32: bool = False,
                 device_kernels: bool = False) -> None:
        unknown = [name for name in outputs if name not in TRL_OUTPUTS]
        if unknown or "log_probs" not in outputs:
            raise ConfigError(f"loss_fn.outputs: got {list(outputs)!r}; allowed: 'log_probs' and any of "
                              f"{', '.join(repr(n) for n in TRL_OUTPUTS[1:])}")
        for key, value in (("temperature", temperature), ("logit_scale", logit_scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"loss_fn.{key}: got {value!r}; allowed: a positive number")
        if logit_softcap is not None and not (isinstance(logit_softcap, (int, float)) and 0 < logit_softcap < math.inf):
            raise ConfigError(f"loss_fn.logit_softcap: got {logit_softcap!r}; allowed: None or a positive number")
        self.outputs = tuple(outputs)
        self.temperature = float(temperature)
        self.logit_softcap = float(logit_softcap) if logit_softcap is not None else None
        self.logit_scale = float(logit_scale)
        self.cast_lm_head_to_fp32 = bool(cast_lm_head_to_fp32)
        self.device_kernels = bool(device_kernels)
        self._head = _StandIn(self)

    def __repr__(self) -> str:
        return (f"TRLFusedLMHead(outputs={self.outputs!r}, temperature={self.temperature}, "
                f"logit_softcap={self.logit_softcap}, logit_scale={self.logit_scale})")

    def __call__(self, hidden: Tensor, weight: Tensor, labels: Tensor, *, bias: Tensor | None = None,
                 num_label_tokens: int | float | Tensor | None = None) -> Tensor:
        """The loss of ``hidden [batch, seq, hidden]`` through ``weight [vocab, hidden]`` against HF-convention
        ``labels [batch, seq]`` (shifted by TRL, -100 ignored)."""
        if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
            raise ConfigError(f"TRLFusedLMHead: got hidden states {tuple(hidden.shape)} and labels "
                              f"{tuple(labels.shape)}; allowed: [batch, seq, hidden] and [batch, seq]")
        with self._device_kernels(hidden):
            return self._head.loss(hidden, weight, bias, labels, num_label_tokens)

    @contextlib.contextmanager
    def _device_kernels(self, hidden: Tensor) -> Iterator[None]:
        if not self.device_kernels:
            yield
            return
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(hidden, FakeTensor):
            raise ConfigError("loss_fn.device_kernels: true runs TRL's GPU path with its kernels stubbed out, for an "
                              "estimate on fake tensors only; allowed on real tensors: false")
        with self.device_kernel_scope():
            yield

    @contextlib.contextmanager
    def device_kernel_scope(self) -> Iterator[None]:
        """TRL's GPU path with its kernels stubbed out while the scope is open (nothing when ``device_kernels`` is
        off). The call opens it for the forward; a simulated step opens it around the whole step, so that the
        backward, which runs after the call returned, takes the GPU path too (NOTE [ TRL's backward runs after the
        call ])."""
        if not self.device_kernels:
            yield
            return
        from trl.kernels import chunked_logprob
        from trl.trainer import utils

        kernel = _StubKernel()
        patches = [(utils, "_use_triton", lambda device: True), (chunked_logprob, "_use_triton", lambda device: True),
                   (chunked_logprob, "_forward_kernel", kernel), (chunked_logprob, "_backward_kernel", kernel)]
        if hasattr(chunked_logprob, "_addmm_fp32"):
            patches.append((chunked_logprob, "_addmm_fp32", _accumulate_in_place))
        if not hasattr(chunked_logprob, "triton"):  # no Triton here (a CPU build of torch): the grid's arithmetic
            patches.append((chunked_logprob, "triton", types.SimpleNamespace(cdiv=lambda a, b: -(-a // b))))
        missing = object()
        saved = [(module, name, getattr(module, name, missing)) for module, name, _ in patches]
        try:
            for module, name, value in patches:
                setattr(module, name, value)
            yield
        finally:
            for module, name, value in saved:
                if value is missing:
                    delattr(module, name)
                else:
                    setattr(module, name, value)


def _accumulate_in_place(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """TRL's ``_addmm_fp32`` (``acc += a @ b`` into a float32 ``acc``) as it runs on a GPU: one ``addmm`` with
    ``out_dtype=float32`` into ``acc``, which allocates nothing.

    # NOTE [ TRL's backward runs after the call ]
    # TRL's GPU path was stubbed in only while the loss was called, so the simulated backward, which autograd runs
    # later, took TRL's CPU path: whole float32 tiles (``zeros_like``, ``exp``, products) where the GPU's Triton
    # kernel folds in place, and float32 copies of both operands of each gradient accumulation, where the GPU's
    # ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` (its branch for CUDA tensors, which fake CPU
    # tensors are not) makes none. The estimate of a CUDA step was 2.36 GiB too high at the peak of TRL's backward
    # (Llama-3.2-1B shape, 4 x 1024 tokens, bf16: 12.17 GiB predicted, 9.81 measured on an H200, torch 2.11). The
    # simulated step now opens `TRLFusedLMHead.device_kernel_scope` around forward and backward, and the
    # accumulation is this in-place stand-in: its values do not matter on fake tensors, its allocations do.
    """


class _StubKernel:
    """A Triton kernel launched as ``kernel[grid](...)`` that does nothing: TRL's kernels write its buffers in place,
    so on fake tensors the launch allocates nothing, as on the GPU."""

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: None


class _StandIn:
    """The stand-in model TRL's ``add_fused_lm_head`` patches: its backbone returns the hidden states of the call
    in progress, its output embeddings are the real head's weight and bias (held only during the call)."""

    def __init__(self, loss: TRLFusedLMHead) -> None:
        from trl.trainer.utils import add_fused_lm_head

        text = types.SimpleNamespace(final_logit_softcapping=loss.logit_softcap, logit_scale=loss.logit_scale,
                                     output_router_logits=False, model_type="remat-stand-in")
        self.config = types.SimpleNamespace(get_text_config=lambda: text)
        self._call: tuple[Tensor, Tensor, Tensor | None] | None = None
        options = {"temperature": loss.temperature, "cast_lm_head_to_fp32": loss.cast_lm_head_to_fp32,
                   "outputs": loss.outputs}
        taken = inspect.signature(add_fused_lm_head).parameters  # what this TRL's head has (outputs came in 1.x)
        add_fused_lm_head(self, **{k: v for k, v in options.items() if k in taken})  # type: ignore[arg-type]

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # the unpatched forward: never called with fused_lm_head
        raise ConfigError("TRLFusedLMHead: the stand-in model has no forward of its own")

    def base_model(self, *args: Any, **kwargs: Any) -> Any:
        assert self._call is not None
        return types.SimpleNamespace(last_hidden_state=self._call[0])

    def get_output_embeddings(self) -> Any:
        assert self._call is not None
        return types.SimpleNamespace(weight=self._call[1], bias=self._call[2])

    def loss(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor,
             num_label_tokens: int | float | Tensor | None) -> Tensor:
        self._call = (hidden, weight, bias)
        try:
            out = self.forward(labels=labels, fused_lm_head=True, num_items_in_batch=num_label_tokens)
        finally:
            self._call = None
        return out.loss


def trl_forward(model: Any) -> Any:
    """The function TRL installed as ``model``'s forward on the instance (its fused LM head), or None."""
    function = getattr(getattr(model, "__dict__", {}).get("forward"), "__func__", None)
    code = getattr(function, "__code__", None)
    return function if code is not None and "trl" in Path(code.co_filename).parts else None


def trl_head_options(model: Any) -> dict[str, Any] | None:
    """The `TRLFusedLMHead` keywords that reproduce the fused LM head TRL installed on ``model`` (read from TRL's
    patched forward: the ``add_fused_lm_head`` arguments and what it read from the config), or None where TRL did
    not patch it."""
    function = trl_forward(model)
    if function is None or "fused_lm_head" not in function.__code__.co_varnames:
        return None
    cells: dict[str, Any] = {}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        with contextlib.suppress(ValueError):  # a cell not filled yet
            cells[name] = cell.cell_contents
    return {"outputs": list(cells.get("outputs", SFT_OUTPUTS)), "temperature": float(cells.get("temperature", 1.0)),
            "logit_softcap": cells.get("final_logit_softcapping"), "logit_scale": float(cells.get("logit_scale", 1.0)),
            "cast_lm_head_to_fp32": bool(cells.get("cast_lm_head_to_fp32", False))}
