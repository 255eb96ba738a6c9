"""A float64 reference of the next-token loss, written independently of remat.loss (shifts the logits, not labels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def reference_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None = None,
                     softcap: float | None = None) -> Tensor:
    """``cap * tanh((hidden @ weight.T + bias) / cap)`` in float64."""
    logits = hidden.double() @ weight.double().T
    if bias is not None:
        logits = logits + bias.double()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def reference_loss_from_logits(logits: Tensor, labels: Tensor, ignore_index: int = -100, reduction: str = "mean",
                               num_label_tokens: float | None = None) -> Tensor:
    """Classic HF-style loss: drop the last logit and the first label of every row, float64."""
    shifted_logits = logits[..., :-1, :].reshape(-1, logits.shape[-1]).double()
    shifted_labels = labels[..., 1:].reshape(-1)
    total = F.cross_entropy(shifted_logits, shifted_labels, ignore_index=ignore_index, reduction="sum")
    if reduction == "sum":
        return total
    count = num_label_tokens if num_label_tokens is not None else int((shifted_labels != ignore_index).sum())
    return total / max(count, 1)


def reference_loss(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None,
                   softcap: float | None = None, ignore_index: int = -100, reduction: str = "mean",
                   num_label_tokens: float | None = None) -> Tensor:
    """The loss of the output head applied to ``hidden``, float64, differentiable w.r.t. the inputs."""
    logits = reference_logits(hidden, weight, bias, softcap)
    return reference_loss_from_logits(logits, labels, ignore_index, reduction, num_label_tokens)


def plain_head_loss(labels: Tensor, softcap: float | None = None):
    """The unfused loss in the inputs' own dtype, as a model computes it: ``f(hidden, weight, bias) -> loss``."""
    from remat.loss import MaskedCrossEntropy

    def plain(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        logits = F.linear(hidden, weight, bias)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return MaskedCrossEntropy()(logits, labels)

    return plain


def loss_and_grads(loss_fn, tensors: list[Tensor], *args, **kwargs) -> tuple[Tensor, list[Tensor | None]]:
    """Run ``loss_fn(*tensors, *args, **kwargs)`` on fresh leaf copies; return the loss and the leaves' grads."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in tensors]
    loss = loss_fn(*leaves, *args, **kwargs)
    loss.backward()
    return loss.detach(), [leaf.grad if leaf is not None else None for leaf in leaves]


def random_labels(shape: tuple[int, ...], vocab: int, ignore_fraction: float, generator: torch.Generator,
                  ignore_index: int = -100) -> Tensor:
    """Random token ids with about ``ignore_fraction`` of them set to ``ignore_index``."""
    labels = torch.randint(0, vocab, shape, generator=generator)
    mask = torch.rand(shape, generator=generator) < ignore_fraction
    return labels.masked_fill(mask, ignore_index)
