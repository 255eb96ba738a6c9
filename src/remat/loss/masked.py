"""The plain next-token cross-entropy on logits that the model has already computed."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from remat.arguments import checked_keywords
from remat.errors import ConfigError
from remat.loss.contract import LossInput
from remat.loss.targets import (
    Reduction,
    check_labels,
    check_reduction,
    check_target_range,
    loss_divisor,
    next_token_targets,
)


class MaskedCrossEntropy:
    """Next-token cross-entropy of ``logits [..., T, V]`` against HF-convention ``labels [..., T]``.

    The labels are shifted here (``logits[..., t, :]`` predicts ``labels[..., t + 1]``); tokens labelled
    ``ignore_index`` do not count. The math runs in fp32 (fp64 for fp64 logits) (which costs an fp32 copy of
    the logits when they are bf16: that is what :class:`FusedLinearCrossEntropy` avoids).
    """

    consumes: ClassVar[LossInput] = "logits"

    @checked_keywords
    def __init__(self, ignore_index: int = -100, reduction: Reduction = "mean") -> None:
        self.ignore_index = int(ignore_index)
        self.reduction: Reduction = check_reduction(reduction)

    def __repr__(self) -> str:
        return f"MaskedCrossEntropy(ignore_index={self.ignore_index}, reduction={self.reduction!r})"

    def __call__(
        self, logits: Tensor, labels: Tensor, num_label_tokens: int | float | Tensor | None = None, *,
        shift: bool = True,
    ) -> Tensor:
        """Return the fp32 scalar loss; "mean" divides by ``num_label_tokens`` if given, else by the label count.

        ``shift=False``: ``labels`` are already next-token targets, one per position (context parallelism's shards,
        `remat.loss.targets.next_token_targets`)."""
        if logits.dim() < 2 or not logits.dtype.is_floating_point:
            raise ConfigError(
                f"logits: got shape {tuple(logits.shape)} and dtype {logits.dtype}; "
                "allowed: a floating tensor [..., sequence, vocab]"
            )
        check_labels(labels, logits.shape[:-1], "logits")
        targets = next_token_targets(labels.to(logits.device), self.ignore_index, shift=shift)
        check_target_range(targets, logits.shape[-1], self.ignore_index)
        num_valid = int((targets != self.ignore_index).sum())
        divisor = loss_divisor(self.reduction, num_valid, num_label_tokens)
        flat_logits = logits.reshape(-1, logits.shape[-1])
        flat_logits = flat_logits.to(torch.promote_types(flat_logits.dtype, torch.float32))
        total = F.cross_entropy(flat_logits, targets, ignore_index=self.ignore_index, reduction="sum")
        return total / divisor
