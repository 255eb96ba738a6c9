"""Run a causal LM on a batch and compute the training loss, with or without materialising the logits.

Two contracts, chosen by the recipe:
- logits: ``loss_fn(logits, labels, num_label_tokens=...)`` (``remat.loss.MaskedCrossEntropy``);
- hidden states (``model.output_hidden_states: true``): the decoder's last hidden states and the output head's weight
  go to ``loss_fn(hidden_states, weight, labels, bias=..., num_label_tokens=...)``
  (``remat.loss.FusedLinearCrossEntropy``), and the output head never runs.

``CausalLMLoss`` is an ``nn.Module`` holding the model, so that data-parallel wrappers can wrap the whole loss
computation: under FSDP2 it is the root unit, whose forward gathers the parameters outside the transformer blocks
(embeddings, final norm, output head) around the decoder *and* the loss, so the fused loss sees the whole head weight
and its gradient is reduce-scattered back to the shards; under DDP its forward is what DDP runs, so every gradient
the loss produces is all-reduced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.data import IGNORE_INDEX
from remat.errors import ConfigError

MODEL_INPUTS: tuple[str, ...] = ("input_ids", "attention_mask", "position_ids")


def count_label_tokens(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> int:
    """Tokens that contribute to the loss: labels are shifted by one (position t predicts t+1)."""
    return int((labels[..., 1:] != ignore_index).sum())


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model under a ``peft`` wrapper (LoRA layers stay injected in it)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


@dataclass(frozen=True)
class _DecoderAndHead:
    decoder: nn.Module
    head: nn.Module


class CausalLMLoss(nn.Module):
    """Computes the loss of one micro-batch for a transformers causal LM (optionally peft-wrapped):
    ``loss = CausalLMLoss(model, loss_fn, use_hidden_states=...)(batch, num_label_tokens=n)``."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], *, use_hidden_states: bool) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.use_hidden_states = use_hidden_states
        base = unwrap_peft(model)
        self.model = model
        if use_hidden_states:
            decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
            head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
            if decoder is None or head is None or not hasattr(head, "weight"):
                raise ConfigError(
                    f"model.output_hidden_states: {type(base).__name__} does not expose a decoder and an output "
                    "head (get_decoder / get_output_embeddings), so the fused loss cannot get hidden states; "
                    "use loss_fn._target_: remat.loss.MaskedCrossEntropy for this model"
                )
            # Plain references, not submodules: the parameters are registered once, under `model`.
            self._parts = _DecoderAndHead(decoder, head)
            softcap = getattr(base.config, "final_logit_softcapping", None)
            if softcap and getattr(loss_fn, "logit_softcap", "absent") is None:
                loss_fn.logit_softcap = float(softcap)  # type: ignore[attr-defined]

    @property
    def decoder(self) -> nn.Module:
        """The decoder whose last hidden states feed the fused loss (hidden-states contract only)."""
        return self._parts.decoder

    @property
    def head(self) -> nn.Module:
        """The output head whose weight the fused loss applies (hidden-states contract only)."""
        return self._parts.head

    def forward(self, batch: Mapping[str, torch.Tensor], num_label_tokens: int | None = None) -> torch.Tensor:
        inputs: dict[str, Any] = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        labels = batch["labels"]
        if self.use_hidden_states:
            hidden = self.decoder(**inputs, use_cache=False).last_hidden_state
            # Read inside forward: under FSDP2 the root has gathered the whole weight by now.
            bias = getattr(self.head, "bias", None)
            return self.loss_fn(hidden, self.head.weight, labels, bias=bias, num_label_tokens=num_label_tokens)
        logits = self.model(**inputs, use_cache=False).logits
        return self.loss_fn(logits, labels, num_label_tokens=num_label_tokens)
