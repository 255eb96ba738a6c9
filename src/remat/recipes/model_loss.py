"""Run a causal LM on a batch and compute the training loss, with or without materialising the logits.

Two contracts, chosen by the recipe:
- logits: ``loss_fn(logits, labels, num_label_tokens=...)`` (``remat.loss.MaskedCrossEntropy``);
- hidden states (a loss whose ``consumes`` is ``"hidden_states"``): the decoder's last hidden states and the output head's weight
  go to ``loss_fn(hidden_states, weight, labels, bias=..., num_label_tokens=...)``
  (``remat.loss.FusedLinearCrossEntropy``), and the output head never runs.

``CausalLMLoss`` is an ``nn.Module`` holding the model, so that data-parallel wrappers can wrap the whole loss
computation: under FSDP2 it is the root unit, whose forward gathers the parameters outside the transformer blocks
(embeddings, final norm, output head) around the decoder *and* the loss, so the fused loss sees the whole head weight
and its gradient is reduce-scattered back to the shards; under DDP its forward is what DDP runs, so every gradient
the loss produces is all-reduced.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from remat.data import IGNORE_INDEX
from remat.errors import ConfigError
from remat.loss import output_head, verify_output_head
from remat.recipes.attention_mask import without_redundant_mask

if TYPE_CHECKING:
    from remat.distributed.context_parallel import ContextShards

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
    base: nn.Module


class CausalLMLoss(nn.Module):
    """Computes the loss of one micro-batch for a transformers causal LM (optionally peft-wrapped):
    ``loss = CausalLMLoss(model, loss_fn, use_hidden_states=...)(batch, num_label_tokens=n)``.

    ``context``: this rank's context-parallel group (`remat.distributed.DistributedSetup.context`): each row is cut
    to this rank's shard of tokens before the model runs, and the loss gets the shard's next-token targets
    (``shift=False``); the loss is this rank's share, summed over its group by the data-parallel wrapper."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], *, use_hidden_states: bool,
                 context: ContextShards | None = None) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.use_hidden_states = use_hidden_states
        self.context = context
        self._blocks_checked = context is None
        if context is not None and not _takes_shift(loss_fn):
            raise ConfigError(f"distributed.cp_size: {context.size} needs a loss that takes next-token targets "
                              f"(a `shift` keyword); {getattr(loss_fn, '__name__', type(loss_fn).__name__)} has none; "
                              "allowed: remat.loss.MaskedCrossEntropy or remat.loss.FusedLinearCrossEntropy")
        base = unwrap_peft(model)
        self.model = model
        if use_hidden_states:
            decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
            if decoder is None:
                raise ConfigError(
                    f"loss_fn._target_: {type(base).__name__} does not expose its decoder "
                    "(get_decoder), so the fused loss cannot get hidden states; "
                    "use loss_fn._target_: remat.loss.MaskedCrossEntropy for this model"
                )
            verify_output_head(base)  # the head the fused loss applies gives the model's own logits, or one line
            head = output_head(base)
            if head.logit_softcap and getattr(loss_fn, "logit_softcap", "absent") is None:
                loss_fn.logit_softcap = head.logit_softcap  # type: ignore[attr-defined]
            # Plain references, not submodules: the parameters are registered once, under `model`.
            self._parts = _DecoderAndHead(decoder, base)

    @property
    def decoder(self) -> nn.Module:
        """The decoder whose last hidden states feed the fused loss (hidden-states contract only)."""
        return self._parts.decoder


    def forward(self, batch: Mapping[str, torch.Tensor], num_label_tokens: int | None = None) -> torch.Tensor:
        # a right-padding mask changes nothing for a causal LM but would make transformers build [tokens, tokens]
        inputs: dict[str, Any] = without_redundant_mask({k: batch[k] for k in MODEL_INPUTS if k in batch})
        labels = batch["labels"]
        extra: dict[str, Any] = {}
        context = self.context
        calls_before = context.attention_calls if context is not None else 0
        if context is not None:
            inputs, labels = context.shard(inputs, labels, ignore_index=getattr(self.loss_fn, "ignore_index",
                                                                                 IGNORE_INDEX))
            extra["shift"] = False
        if self.use_hidden_states:
            hidden = self.decoder(**inputs, use_cache=False).last_hidden_state
            self._check_blocks(calls_before)
            # Read inside forward: under FSDP2 the root has gathered the whole weight by now.
            head = output_head(self._parts.base)
            if head.hidden_scale != 1.0:
                hidden = hidden * head.hidden_scale
            return self.loss_fn(hidden, head.weight, labels, bias=head.bias, num_label_tokens=num_label_tokens,
                                **extra)
        logits = self.model(**inputs, use_cache=False).logits
        self._check_blocks(calls_before)
        return self.loss_fn(logits, labels, num_label_tokens=num_label_tokens, **extra)

    def _check_blocks(self, calls_before: int) -> None:
        """Context parallelism, first forward: every block ran the split attention (no layer saw only its shard)."""
        if self._blocks_checked or self.context is None:
            return
        from remat.checkpointing.discovery import find_blocks
        from remat.distributed.context_parallel import check_every_block_attends

        check_every_block_attends(self.context, calls_before, len(find_blocks(self.model).blocks))
        self._blocks_checked = True


def _takes_shift(loss_fn: Callable[..., torch.Tensor]) -> bool:
    try:
        parameters = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        return False
    return "shift" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
