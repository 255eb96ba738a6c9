"""What the fused loss needs from a causal LM: its output head's weight and bias and how the logits are shaped."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor  # what tensors are under the estimate's FakeTensorMode

from remat.errors import ConfigError


#: Config attributes through which Hugging Face models scale their logits after the head (value 1.0 = no effect).
SCALING_ATTRIBUTES: tuple[str, ...] = ("logits_scaling", "logit_scale", "lm_head_multiplier")

#: Config attributes through which Hugging Face models cap their logits (``cap * tanh(logits / cap)``).
SOFTCAP_ATTRIBUTES: tuple[str, ...] = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")

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
    softcap = next((value for candidate in (config, text_config) for name in SOFTCAP_ATTRIBUTES
                    if (value := getattr(candidate, name, None))), None)
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


#: Tokens of the probe `verify_output_head` runs; the largest relative difference it accepts, per parameter dtype.
PROBE_TOKENS = 8
PROBE_TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-4, torch.float64: 1e-6}
LOW_PRECISION_TOLERANCE = 3e-2
#: Relative difference accepted between the model's own probe loss and the next-token loss of the same logits, per
#: dtype of the model's loss: both come from one set of logits, so only the order of the sum (or a loss computed in
#: bf16/fp16, LOW_PRECISION_TOLERANCE) differs.
LOSS_TOLERANCE: dict[torch.dtype, float] = {torch.float32: 1e-5, torch.float64: 1e-9}


def _probe(model: nn.Module, decoder: nn.Module, head: OutputHead, name: str) -> tuple[Tensor, Tensor, Tensor, Any]:
    """The model's own logits on the probe tokens, the logits the fused loss's head rebuilds from the decoder, probe
    labels far apart under the two label conventions, and the model's own loss on them (evaluation mode, no
    gradients; any failure is one ConfigError line)."""
    vocab = head.weight.shape[0]
    ids = ((torch.arange(PROBE_TOKENS, device=head.weight.device) * 7919 + 11) % vocab).unsqueeze(0)
    was_training = model.training
    model.eval()  # dropout off: both runs must see the same network
    try:
        with torch.no_grad():
            output = decoder(input_ids=ids, use_cache=False)
            hidden = getattr(output, "last_hidden_state", None)
            if not isinstance(hidden, Tensor):
                raise ConfigError(
                    f"loss_fn: FusedLinearCrossEntropy needs the last hidden state of {name}, but its decoder "
                    f"({type(decoder).__name__}) returns {type(output).__name__} without one; allowed: "
                    "loss_fn._target_: remat.loss.MaskedCrossEntropy")
            expected = model(input_ids=ids, use_cache=False).logits.float()
            rebuilt = _apply_head(hidden.float(), head)
            # labels each position's own logits predict best one step later: the shifted and the unshifted
            # conventions then give far apart losses, even from a freshly initialised model's near-uniform logits
            labels = torch.cat([ids[:, :1], expected[:, :-1].argmax(-1)], dim=1)
            return expected, rebuilt, labels, _own_loss(model, name, ids, labels)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 (any failure of the probe is said in one line, not a traceback)
        raise ConfigError(f"loss_fn: FusedLinearCrossEntropy cannot rebuild the logits of {name} from its decoder "
                          f"({type(err).__name__}: {' '.join(str(err).split())[:200]}); allowed: loss_fn._target_: "
                          "remat.loss.MaskedCrossEntropy") from None
    finally:
        model.train(was_training)


def _compare_logits(name: str, head: OutputHead, rebuilt: Tensor, expected: Tensor) -> None:
    if rebuilt.shape != expected.shape:
        raise ConfigError(f"loss_fn: the logits of {name} have shape {tuple(expected.shape)}, the fused loss's "
                          f"{tuple(rebuilt.shape)}; allowed: loss_fn._target_: remat.loss.MaskedCrossEntropy")
    tolerance = PROBE_TOLERANCE.get(head.weight.dtype, LOW_PRECISION_TOLERANCE)
    difference = float((rebuilt - expected).abs().max() / expected.abs().max().clamp_min(1e-6))
    if not difference <= tolerance:  # NaN included
        raise ConfigError(
            f"loss_fn: {name} computes its logits otherwise than hidden @ lm_head.weight.T (+ bias, softcap, scale) "
            f"as FusedLinearCrossEntropy would (relative difference {difference:.3g} on a probe of {PROBE_TOKENS} "
            f"tokens, allowed {tolerance:g}): its loss would differ from the model's own; allowed: loss_fn._target_: "
            "remat.loss.MaskedCrossEntropy for this model")


def verify_output_head(model: nn.Module) -> None:
    """Check once, on a probe of a few tokens, that the head the fused loss applies to ``get_decoder()``'s last
    hidden state reproduces the model's own logits; ConfigError naming the model type and the difference when it
    does not (a transform before the head, a cap or scale under a name remat does not know), or when the decoder
    gives no last hidden state. A no-op on fake or meta tensors (the estimate), where no value can be compared.

    # NOTE [ Why a probe ]
    # The fused loss rebuilds the logits from the output head's weight, so every model whose logits are more than
    # ``hidden @ weight.T + bias`` (BERT-style decoders' dense + activation + norm transform, a softcap under its own
    # config name) would train on a different loss, silently. A table of known heads cannot cover an architecture
    # nobody has tried; comparing the two on eight tokens before the first step can: it costs one small forward.
    """
    head = output_head(model)
    if isinstance(head.weight, FakeTensor) or head.weight.is_meta:
        return
    name = f"{type(model).__name__} (model_type {getattr(getattr(model, 'config', None), 'model_type', None)!r})"
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    if not isinstance(decoder, nn.Module) or decoder is model:
        raise ConfigError(f"loss_fn: FusedLinearCrossEntropy needs the decoder of {name}, whose get_decoder() gives "
                          f"{type(decoder).__name__}; allowed: loss_fn._target_: remat.loss.MaskedCrossEntropy")
    expected, rebuilt, labels, own_loss = _probe(model, decoder, head, name)
    _compare_logits(name, head, rebuilt, expected)
    _check_label_convention(name, labels, expected, own_loss)


def _own_loss(model: nn.Module, name: str, ids: Tensor, labels: Tensor) -> Any:
    """The model's own loss of ``labels`` on the probe; None when its forward takes no labels."""
    try:
        return getattr(model(input_ids=ids, labels=labels, use_cache=False), "loss", None)
    except TypeError as err:
        if "labels" in str(err):
            return None
        failure = err
    except Exception as err:  # noqa: BLE001 (said in one line below)
        failure = err
    raise ConfigError(f"loss_fn: {name}: its own loss fails on a probe of {PROBE_TOKENS} tokens "
                      f"({type(failure).__name__}: {' '.join(str(failure).split())[:200]}), so FusedLinearCrossEntropy "
                      "cannot be checked to train the same objective; allowed: loss_fn._target_: "
                      "remat.loss.MaskedCrossEntropy")


def _check_label_convention(name: str, labels: Tensor, logits: Tensor, own_loss: Any) -> None:
    """ConfigError when the model's own loss of ``labels`` is not the next-token loss of its own ``logits``.

    # NOTE [ The loss, not only the logits ]
    # Equal logits are not enough: the fused loss (like MaskedCrossEntropy and every causal LM built on
    # transformers' ForCausalLMLoss) predicts token t+1 from position t, but a dozen decoders kept from
    # encoder-decoder families (bart, marian, pegasus, whisper, xlnet, ...) compute their causal-LM loss on
    # unshifted labels: their callers shift the labels before the call. Trained with the fused loss they would learn
    # another objective. The probe already holds the model's own logits, so the model's own loss of the same call
    # costs nothing more: it must equal the shifted cross-entropy of those logits (same logits, so only the sum's
    # order differs, and the rounding of a loss summed in bf16), else the fused loss is refused.
    """
    if not isinstance(own_loss, Tensor) or own_loss.numel() != 1:
        return  # a forward that computes no loss of its own: the fused loss is the only one there is
    shifted = float(torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:]))
    unshifted = float(torch.nn.functional.cross_entropy(logits[0], labels[0]))
    value = float(own_loss)
    tolerance = LOSS_TOLERANCE.get(own_loss.dtype, LOW_PRECISION_TOLERANCE)
    close = tolerance * max(abs(shifted), 1.0)
    if abs(value - shifted) <= close and (abs(value - shifted) < abs(value - unshifted)
                                          or abs(shifted - unshifted) <= close):  # the probe cannot tell them apart
        return
    convention = ("its own loss does not shift the labels (it predicts each label at its own position)"
                  if abs(value - unshifted) < abs(value - shifted)
                  else "its own loss is not the next-token cross-entropy of its logits")
    raise ConfigError(
        f"loss_fn: {name}: {convention}, while FusedLinearCrossEntropy predicts token t+1 from position t (own loss "
        f"{value:.6g}, next-token loss {shifted:.6g} on a probe of {PROBE_TOKENS} tokens): training would optimise "
        "another objective; allowed: loss_fn._target_: remat.loss.MaskedCrossEntropy for this model")


def _apply_head(hidden: Tensor, head: OutputHead) -> Tensor:
    logits = (hidden * head.hidden_scale) @ head.weight.float().T
    if head.bias is not None:
        logits = logits + head.bias.float()
    if head.logit_softcap:
        logits = head.logit_softcap * torch.tanh(logits / head.logit_softcap)
    return logits
