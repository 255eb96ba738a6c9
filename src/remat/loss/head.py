"""What the fused loss needs from a causal LM: its output head's weight and bias and how the logits are shaped."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from remat.errors import ConfigError


#: Config attributes through which Hugging Face models scale their logits after the head (value 1.0 = no effect).
SCALING_ATTRIBUTES: tuple[str, ...] = ("logits_scaling", "logit_scale", "lm_head_multiplier")

#: model_type -> the factor the model multiplies its logits by, read from its config.
LOGIT_MULTIPLIERS: dict[str, Callable[[Any], float]] = {
    **{name: (lambda config: 1.0 / float(config.logits_scaling)) for name in (
        "granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared",
        "granite4_vision_text", "granite_docling_text")},
    **{name: (lambda config: float(config.logit_scale)) for name in ("cohere", "cohere2", "cohere2_moe")},
    "hyperclovax": lambda config: float(config.logits_scaling),
    "falcon_h1": lambda config: float(config.lm_head_multiplier),
}


@dataclass(frozen=True)
class OutputHead:
    """The output projection of a model, as ``FusedLinearCrossEntropy`` consumes it.

    ``logits = cap * tanh(((hidden_scale * hidden) @ weight.T + bias) / cap)`` (``cap = logit_softcap``) where
    ``hidden`` is the model's last hidden state (after the final norm: ``model.get_decoder()(...).last_hidden_state``).
    ``hidden_scale`` folds a model's fixed logit multiplier into the hidden states (see ``LOGIT_MULTIPLIERS``);
    it is 1.0 for most models.
    """

    weight: Tensor
    bias: Tensor | None
    logit_softcap: float | None
    hidden_scale: float


def output_head(model: nn.Module) -> OutputHead:
    """The output head of a Hugging Face causal LM (or any module with ``get_output_embeddings()``).

    Raises ConfigError when the model has no plain linear output head (none at all, or one wrapped by an adapter
    such as a LoRA layer, whose output the weight alone does not give).
    """
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is None:
        raise ConfigError(
            f"loss_fn: FusedLinearCrossEntropy needs the model's output head, but {type(model).__name__} has no "
            "get_output_embeddings(); allowed: a causal LM with a linear output head (else use MaskedCrossEntropy)"
        )
    if type(head) is not nn.Linear:
        raise ConfigError(
            f"loss_fn: the output head of {type(model).__name__} is a {type(head).__name__}; allowed: a plain "
            "nn.Linear (FusedLinearCrossEntropy applies the weight itself: keep lm_head out of LoRA target_modules, "
            "or use MaskedCrossEntropy)"
        )
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(config, "final_logit_softcapping", None) or getattr(text_config, "final_logit_softcapping", None)
    scale = _logit_multiplier(config, text_config)
    if scale != 1.0 and head.bias is not None:
        raise ConfigError(
            f"loss_fn: {type(model).__name__} scales its logits by {scale} after a head with a bias; allowed: "
            "FusedLinearCrossEntropy folds a logit scale into the hidden states only for heads without a bias"
        )
    return OutputHead(weight=head.weight, bias=head.bias, logit_softcap=float(softcap) if softcap else None,
                      hidden_scale=scale)


def _logit_multiplier(config: Any, text_config: Any) -> float:
    """The factor the model multiplies its logits by; ConfigError for a scaling attribute of an unknown model."""
    for candidate in (config, text_config):
        model_type = getattr(candidate, "model_type", None)
        if model_type in LOGIT_MULTIPLIERS:
            return LOGIT_MULTIPLIERS[model_type](candidate)
    for candidate in (config, text_config):
        for name in SCALING_ATTRIBUTES:
            value = getattr(candidate, name, None)
            if value is not None and float(value) != 1.0:
                raise ConfigError(
                    f"loss_fn: model_type {getattr(candidate, 'model_type', None)!r} sets {name}={value}, a logit "
                    f"scaling FusedLinearCrossEntropy does not know how to apply; allowed: the model types "
                    f"{sorted(LOGIT_MULTIPLIERS)} or {name}=1 (else use MaskedCrossEntropy)"
                )
    return 1.0
