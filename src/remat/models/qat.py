"""Quantization-aware training through torchao (the recipe's ``qat`` section; NeMo AutoModel's keys): the linear
layers train through fake quantisation, so the model learns weights that survive the int4 (and int8-activation)
quantisation it will be served with.

# NOTE [ Fake quantisation, and when it starts ]
# torchao's QAT quantizers replace every ``nn.Linear`` whose input features divide by ``groupsize`` with a layer of
# the same parameters whose forward quantises and dequantises its weight (int4, per group of ``groupsize``; symmetric)
# and, for ``int8_dynact_int4weight``, its input (int8, per token, asymmetric) with straight-through gradients. Those
# are ordinary tensor ops: activation checkpointing recomputes them exactly, the estimate simulates them on fake
# tensors, and FSDP2 shards the same parameters. The scales and zero points are computed in the model's dtype (NeMo
# defaults them to bfloat16 so that FSDP2 sees one dtype), but for ``int4_weight_only``, whose scales torchao keeps
# in bfloat16 only. ``fake_quant_after_n_steps: N`` trains the first N steps in
# full precision and fake-quantises from step N + 1 on (NeMo's schedule; a resumed run sets it from its step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import NonNegativeInt, PositiveInt

from remat.config_base import StrictModel
from remat.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

QuantizerType = Literal["int8_dynact_int4weight", "int4_weight_only"]


class QATConfig(StrictModel):
    """``qat``: quantization-aware training of the linear layers (torchao; off unless ``enabled``)."""

    enabled: bool = False
    quantizer_type: QuantizerType = "int8_dynact_int4weight"
    """``int8_dynact_int4weight``: int8 dynamic activations and int4 weights; ``int4_weight_only``: int4 weights."""
    groupsize: PositiveInt = 256
    """Weights share one scale per group of this many input features (a layer whose inputs it does not divide stays
    as it is)."""
    fake_quant_after_n_steps: NonNegativeInt = 0
    """Train this many steps in full precision before fake quantisation starts."""


def apply_qat(model: nn.Module, cfg: QATConfig, dtype: torch.dtype) -> int:
    """Replace ``model``'s linear layers by torchao's fake-quantising ones (see the NOTE); returns how many."""
    try:
        from torchao.quantization.qat import Int4WeightOnlyQATQuantizer, Int8DynActInt4WeightQATQuantizer
    except ImportError as err:
        raise ConfigError(f"qat.enabled: true needs torchao ({err}); install it: pip install 'remat[fp8]'") from None
    before = _fake_quantised(model)
    if cfg.quantizer_type == "int4_weight_only":
        _check_int4_layout(model, cfg)
    if cfg.quantizer_type == "int8_dynact_int4weight":
        quantizer = Int8DynActInt4WeightQATQuantizer(groupsize=cfg.groupsize, precision=dtype, scales_precision=dtype)
    else:
        import torch

        # torchao's int4 weight-only scheme keeps its scales in bfloat16 only (its serving kernel's layout)
        quantizer = Int4WeightOnlyQATQuantizer(groupsize=cfg.groupsize, precision=dtype,
                                               scales_precision=torch.bfloat16)
    quantizer.prepare(model)
    converted = _fake_quantised(model) - before
    if not converted:
        raise ConfigError(f"qat.groupsize: {cfg.groupsize} divides the input features of no linear layer of "
                          f"{type(model).__name__}; allowed: a divisor of the hidden size (e.g. 32)")
    return converted


#: torchao's int4 weight-only layout: input features a multiple of 16 x its 8 inner k tiles (it pads none in QAT).
_INT4_K_MULTIPLE = 128


def _check_int4_layout(model: nn.Module, cfg: QATConfig) -> None:
    """ConfigError naming the first bias-free linear layer torchao's int4 weight-only QAT would refuse."""
    from torch import nn

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.bias is None and (
                module.in_features % cfg.groupsize or module.in_features % _INT4_K_MULTIPLE):
            raise ConfigError(f"qat.quantizer_type: int4_weight_only needs every linear layer's input features to be a "
                              f"multiple of {_INT4_K_MULTIPLE} and of qat.groupsize ({cfg.groupsize}); {name} has "
                              f"{module.in_features}; allowed: int8_dynact_int4weight, or another groupsize")


def fake_quant_wanted(cfg: QATConfig, step: int) -> bool:
    """Whether the 1-based ``step`` fake-quantises: exactly when it comes after ``fake_quant_after_n_steps``."""
    return step > cfg.fake_quant_after_n_steps


def set_fake_quant(model: nn.Module, cfg: QATConfig, on: bool) -> None:
    """Fake quantisation of ``model``'s QAT layers on or off (they start on)."""
    from torchao.quantization.qat.linear import (
        disable_4w_fake_quant,
        disable_8da4w_fake_quant,
        enable_4w_fake_quant,
        enable_8da4w_fake_quant,
    )

    if cfg.quantizer_type == "int8_dynact_int4weight":
        model.apply(enable_8da4w_fake_quant if on else disable_8da4w_fake_quant)
    else:
        model.apply(enable_4w_fake_quant if on else disable_4w_fake_quant)


def _fake_quantised(model: nn.Module) -> int:
    return sum(type(module).__name__.endswith("QATLinear") for module in model.modules())
