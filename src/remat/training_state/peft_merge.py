"""A LoRA adapter merged into its base weights from a gathered state dict (the ``model/`` export of a sharded
checkpoint, `remat.training_state.sharded`), without the module: under FSDP2 the peft model's parameters are
shards, so peft's own ``merge_and_unload`` (what the single-process export uses) has no whole weight to merge into.

# NOTE [ Merging from the gathered state ]
# Rank 0 holds the whole state dict of the peft model (base weights under ``...base_layer.weight``, the adapter's
# ``lora_A`` / ``lora_B``); each adapted layer's merged weight is ``W + scaling * B @ A`` (transposed for a
# ``fan_in_fan_out`` layer, ``(B @ A)^T`` for an embedding), computed in float32 and stored in W's dtype, as peft's
# ``get_delta_weight`` defines it; the names lose the peft wrappers so that the base model's ``save_pretrained`` writes
# what ``AutoModelForCausalLM`` loads. Adapters whose merge is more than that sum (DoRA, LoRA biases, variants) are
# refused by name: the adapter/ folder still holds them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.errors import ConfigError
from remat.training_state.layout import save_hf_model

_PREFIX = "base_model.model."


def merged_state_dict(peft_model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state dict with the active LoRA adapter merged in (see the NOTE); ``full`` is the peft
    model's whole state dict (`get_model_state_dict` with ``full_state_dict``), names as the peft model has them."""
    from peft.tuners.lora import LoraLayer

    adapter = peft_model.active_adapter
    deltas: dict[str, torch.Tensor] = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.scaling:
            deltas[f"{name}.base_layer.weight"] = _delta(name, module, adapter, full)
    seen: set[int] = set()
    tied: set[str] = set()  # the second name of a tied weight (the output head): save_pretrained writes one
    for name, param in peft_model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    merged: dict[str, torch.Tensor] = {}
    for key, tensor in full.items():
        if ".lora_" in key or ".original_module." in key or key in tied:
            continue
        if key in deltas:
            tensor = (tensor.float() + deltas[key]).to(tensor.dtype)
        out = key.removeprefix(_PREFIX).replace(".base_layer.", ".").replace(f".modules_to_save.{adapter}.", ".")
        merged[out] = tensor
    return merged


def _delta(name: str, module: Any, adapter: str, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """``scaling * B @ A`` of one adapted layer, shaped like its base weight (float32)."""
    if module.use_dora.get(adapter) or getattr(module, "lora_bias", {}).get(adapter):
        raise ConfigError(f"peft: {name}: a DoRA adapter or a LoRA bias has no merged export from sharded weights; "
                          "allowed: plain LoRA (the adapter/ folder holds the adapter either way)")
    scaling = float(module.scaling[adapter])
    if adapter in getattr(module, "lora_A", {}):
        a, b = full[f"{name}.lora_A.{adapter}.weight"].float(), full[f"{name}.lora_B.{adapter}.weight"].float()
        if a.ndim != 2 or b.ndim != 2:
            raise ConfigError(f"peft: {name}: a LoRA adapter on a {type(module.get_base_layer()).__name__} layer has "
                              "no merged export from sharded weights; allowed: LoRA on linear and embedding layers")
        delta = b @ a
        return (delta.T if getattr(module, "fan_in_fan_out", False) else delta) * scaling
    a = full[f"{name}.lora_embedding_A.{adapter}"].float()
    b = full[f"{name}.lora_embedding_B.{adapter}"].float()
    return (b @ a).T * scaling


def save_merged_export(peft_model: nn.Module, full: dict[str, torch.Tensor], directory: Path) -> None:
    """The ``model/`` export of a LoRA run from the peft model's whole state ``full``: the adapter merged into the base
    weights; 4-bit base weights (`remat.models.quantization`) dequantised first and written as a float model of the
    model's dtype, without a ``quantization_config`` (what the run trained, loadable without bitsandbytes)."""
    from remat.models.quantization import dequantized_weights, is_quantized

    base = peft_model.get_base_model()
    if not is_quantized(base):
        save_hf_model(base, directory, state_dict=merged_state_dict(peft_model, full))
        return
    from transformers import AutoModelForCausalLM

    dtype = base.get_input_embeddings().weight.dtype
    merged = merged_state_dict(peft_model, dequantized_weights(peft_model, full, dtype))
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        twin = AutoModelForCausalLM.from_config(config, dtype=dtype)
    save_hf_model(twin, directory, state_dict=merged)


def whole_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters and persistent buffers by name (a 4-bit layer's packed weight without the
    quantisation constants its state dict adds), as a single process holds them."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
    return {name: tensor.detach() for name, tensor in model.state_dict().items() if name in names}
