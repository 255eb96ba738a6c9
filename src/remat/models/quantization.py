"""``model.quantization``: the pretrained base weights quantised to 4 bits by bitsandbytes as they load, with LoRA
adapters trained over them (QLoRA: Dettmers et al., 2023). The keys are transformers' ``BitsAndBytesConfig`` (and NeMo
AutoModel's ``quantization`` section, which has the same names).

# NOTE [ QLoRA in remat ]
# transformers quantises every linear layer but the output head as `from_pretrained` reads the weights (its
# bitsandbytes quantizer: NF4 blocks of 64 with their absmax, optionally quantised again: double quantisation); the
# layers compute in `bnb_4bit_compute_dtype`. The base weights are frozen, so a recipe with a quantization section
# must train LoRA adapters (`peft`). Activation checkpointing wraps the blocks as for any model (remat's checkpoints
# are non-reentrant: the frozen quantised weights need no input gradient trick). Under FSDP2 the packed weights are
# sharded like any parameter, stored in the model's dtype unless `bnb_4bit_quant_storage` says otherwise (FSDP2 makes
# floating-point parameters of its shards; a uint8 one is refused under fsdp2); each layer keeps its
# quantisation constants, so the gathered weight computes as the unsharded one does (2 gloo ranks train the losses of
# one process). A checkpoint holds the adapters; its `model/` export is the dequantised base with the adapter merged,
# in `model.dtype` (what the run trained, loadable anywhere). The planner and the estimate do not model 4-bit weights
# yet: `auto` and `remat estimate` refuse the section.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import model_validator

from remat.config_base import StrictModel
from remat.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

# In the order of distributed.mixed_precision's choices: pydantic reuses the schema of an equal Literal (the same
# names in any order), so two orders would make one key's message depend on which was validated first.
FloatDtype = Literal["bfloat16", "float16", "float32"]


class QuantizationConfig(StrictModel):
    """``model.quantization`` (bitsandbytes, 4 bits): transformers' `BitsAndBytesConfig` keys."""

    load_in_4bit: bool = True
    """Quantise the base weights to 4 bits as they load (QLoRA); the one mode remat trains."""
    load_in_8bit: bool = False
    """8-bit weights (LLM.int8()): not a mode remat trains; accepted as false (NeMo's recipes write it)."""
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"
    """The 4-bit data type: NF4 (normally distributed weights, QLoRA's) or FP4."""
    bnb_4bit_compute_dtype: FloatDtype | None = None
    """The dtype the quantised layers compute in; null: ``model.dtype``."""
    bnb_4bit_use_double_quant: bool = False
    """Quantise the blocks' absmax constants too (about 0.4 bits a weight less)."""
    bnb_4bit_quant_storage: Literal["uint8", "float32", "bfloat16", "float16"] | None = None
    """The dtype the packed 4-bit values are stored in; null: the model's (FSDP-QLoRA's layout: FSDP2 shards
    floating-point parameters, torch 2.11's refuses a uint8 one)."""

    @model_validator(mode="after")
    def _four_bits(self) -> QuantizationConfig:
        if self.load_in_8bit:
            raise ConfigError("model.quantization.load_in_8bit: true; remat trains 4-bit quantised base weights "
                              "(QLoRA); allowed: load_in_4bit: true, load_in_8bit: false")
        if not self.load_in_4bit:
            raise ConfigError("model.quantization.load_in_4bit: false leaves nothing quantised; allowed: true, or no "
                              "model.quantization section")
        return self

    def bitsandbytes_config(self, dtype: torch.dtype) -> Any:
        """transformers' `BitsAndBytesConfig` for a model whose parameters are ``dtype``."""
        import torch
        from transformers import BitsAndBytesConfig

        check_bitsandbytes()
        compute = getattr(torch, self.bnb_4bit_compute_dtype) if self.bnb_4bit_compute_dtype else dtype
        storage = getattr(torch, self.bnb_4bit_quant_storage) if self.bnb_4bit_quant_storage else dtype
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=self.bnb_4bit_quant_type,
                                  bnb_4bit_compute_dtype=compute,
                                  bnb_4bit_use_double_quant=self.bnb_4bit_use_double_quant,
                                  bnb_4bit_quant_storage=storage)


def check_bitsandbytes() -> None:
    """ConfigError saying how to install bitsandbytes when it is missing."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"model.quantization: needs bitsandbytes ({err}); install it: pip install "
                          "'remat[qlora]'") from None


def dequantized_weights(model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """``state`` (the model's parameters by name, gathered whole) with every 4-bit packed weight replaced by its
    dequantised value in ``dtype``, shaped as the layer's weight; the quantisation constants are the layer's own."""
    import bitsandbytes as bnb

    out = dict(state)
    layers = {id(layer) for layer in four_bit_layers(model)}
    for name, module in model.named_modules():
        if id(module) not in layers:
            continue
        key = f"{name}.weight"
        quant_state = getattr(module.weight, "quant_state", None) or getattr(module, "quant_state", None)
        if key not in out or quant_state is None:
            raise ConfigError(f"model.quantization: {name} has no quantisation state to dequantise its weight from")
        packed = out[key].to(quant_state.absmax.device).contiguous()  # any storage dtype: bitsandbytes views bytes
        if getattr(quant_state, "packing_format_for_cpu", False):  # repacked for bitsandbytes' CPU kernels
            from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

            packed, quant_state = _convert_weight_packed_for_cpu_inverse(packed, quant_state)
        out[key] = bnb.functional.dequantize_4bit(packed, quant_state).to(dtype)
    return out


# NOTE [ bitsandbytes' CPU inference layout ]
# On a CPU with AVX512-BF16, a `Linear4bit` run in eval mode without gradients repacks its weight, once and in place,
# for a bfloat16 kernel, and from then on every forward, training's included, goes through that kernel: after the
# first validation a float32 run would train through bfloat16 products of another layout. remat turns the repacking
# off on every 4-bit layer it loads, so validation, training and the dequantised export compute with one weight.
def keep_one_layout(model: nn.Module) -> int:
    """Turn bitsandbytes' CPU inference repacking off on ``model``'s 4-bit layers (see the NOTE); returns how many."""
    layers = [module for module in model.modules() if hasattr(module, "support_avx512bf16_for_cpu")]
    for module in layers:
        module.support_avx512bf16_for_cpu = False
    return len(layers)


def four_bit_layers(model: nn.Module) -> list[nn.Module]:
    """``model``'s bitsandbytes 4-bit linear layers (found by class name and module, not imported: bitsandbytes is
    imported to build them only; peft's LoRA wrapper of one has the same class name)."""
    return [module for module in model.modules() if type(module).__name__ == "Linear4bit"
            and type(module).__module__.startswith("bitsandbytes.")]


def packed_weights(model: nn.Module) -> dict[int, int]:
    """The ids of ``model``'s 4-bit packed weights (bytes of two 4-bit codes each, stored in a float dtype when
    ``bnb_4bit_quant_storage`` is one, so not numbers a finiteness check can read), each with the number of weights
    it packs."""
    return {id(layer.weight): (state.shape.numel() if (state := getattr(layer.weight, "quant_state", None)) is not None
                               else layer.weight.numel()) for layer in four_bit_layers(model)}


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds 4-bit bitsandbytes layers (`model.quantization`)."""
    return bool(four_bit_layers(model))
