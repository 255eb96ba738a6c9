"""Next-token targets and the loss divisor, shared by the plain and the fused cross-entropy.

Labels follow the Hugging Face convention: they are aligned with the inputs (unshifted) and the loss shifts them,
so position ``t`` of the logits predicts ``labels[..., t + 1]``. Shifting the labels (not the logits) keeps the
logits or hidden states as they are: no copy of a ``[tokens, vocab]`` or ``[tokens, hidden]`` tensor.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from remat.errors import ConfigError

Reduction = Literal["mean", "sum"]
REDUCTIONS: tuple[str, ...] = get_args(Reduction)

def check_reduction(reduction: str) -> Reduction:
    """Return ``reduction`` if it is a supported reduction, else raise a ConfigError naming ``loss_fn.reduction``."""
    if reduction not in REDUCTIONS:
        raise ConfigError(f"loss_fn.reduction: got {reduction!r}; allowed: {', '.join(map(repr, REDUCTIONS))}")
    return reduction  # type: ignore[return-value]


def check_labels(labels: Tensor, leading_shape: torch.Size, what: str) -> None:
    """Raise a ConfigError unless ``labels`` is an integer tensor shaped ``leading_shape`` (the tokens of ``what``)."""
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ConfigError(f"labels: got dtype {labels.dtype}; allowed: an integer dtype (token ids)")
    if labels.shape != leading_shape:
        raise ConfigError(
            f"labels: got shape {tuple(labels.shape)}; allowed: the token shape of {what}, {tuple(leading_shape)}"
        )
    if labels.dim() == 0:
        raise ConfigError("labels: got a scalar; allowed: a tensor of token ids [..., sequence]")


def next_token_targets(labels: Tensor, ignore_index: int, *, shift: bool = True) -> Tensor:
    """Flat int64 targets: ``targets[t] = labels[..., t + 1]``, the last position of every row is ``ignore_index``.

    ``shift=False``: ``labels`` are already each position's target (``labels[..., t]`` is what position ``t``
    predicts), as context parallelism hands them over: a rank's shard of a row ends with a position whose target is
    the first token of the next rank's shard, which HF-convention labels of the shard alone cannot say."""
    if not shift:
        return labels.long().reshape(-1)
    shifted = torch.nn.functional.pad(labels[..., 1:].long(), (0, 1), value=ignore_index)
    return shifted.reshape(-1)


def check_target_range(targets: Tensor, vocab_size: int, ignore_index: int) -> None:
    """Raise a ConfigError if a target that is not ``ignore_index`` lies outside ``[0, vocab_size)``."""
    kept = targets[targets != ignore_index]
    if kept.numel() == 0:
        return
    low, high = int(kept.min()), int(kept.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ConfigError(
            f"labels: got token id {bad}; allowed: ignore_index ({ignore_index}) or an id in [0, {vocab_size})"
        )


def loss_divisor(reduction: Reduction, num_valid: int, num_label_tokens: int | float | Tensor | None) -> float:
    """What the summed token losses are divided by.

    ``"sum"`` divides by 1. ``"mean"`` divides by ``num_label_tokens`` when given (gradient accumulation passes the
    label-token count of the whole accumulated batch, so that the summed micro-batch gradients equal the big batch's)
    and by the number of label tokens that are not ignored otherwise. A batch with no label tokens gives loss 0.
    """
    if reduction == "sum":
        if num_label_tokens is not None:
            raise ConfigError(
                f"num_label_tokens: got {_describe(num_label_tokens)} with loss_fn.reduction='sum'; "
                "allowed: None (num_label_tokens only divides a 'mean' loss)"
            )
        return 1.0
    if num_label_tokens is None:
        return float(max(num_valid, 1))
    if isinstance(num_label_tokens, Tensor) and num_label_tokens.numel() != 1:
        raise ConfigError(
            f"num_label_tokens: got a tensor of shape {tuple(num_label_tokens.shape)}; allowed: a count (one element)"
        )
    value = float(num_label_tokens.item() if isinstance(num_label_tokens, Tensor) else num_label_tokens)
    if not value > 0 or value == float("inf"):
        if num_valid == 0 and value == 0:
            return 1.0
        raise ConfigError(
            f"num_label_tokens: got {_describe(num_label_tokens)}; allowed: a positive finite count "
            f"(this batch has {num_valid} label tokens)"
        )
    return value


def _describe(value: int | float | Tensor) -> str:
    return repr(value.item()) if isinstance(value, Tensor) and value.numel() == 1 else repr(value)
