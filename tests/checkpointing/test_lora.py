"""LoRA through peft works with every policy, without `enable_input_require_grads`: the frozen embedding's output
does not require grad, and every adapter still gets exactly the gradient of the un-checkpointed run."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from ckpt_models import assert_same_grads, batch, tiny_model
from torch import nn

from remat.checkpointing import apply_activation_checkpointing

POLICIES = ["full", "selective", "attention", "mlp", "offload", {"every_n_layers": 2}, "sqrt"]


@functools.cache
def _peft_model() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(tiny_model("llama"), config)
    torch.manual_seed(0)
    with torch.no_grad():  # B starts at zero, which would make every A gradient zero: give it values
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    return model


def _lora_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    ids = batch()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return grads


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_lora_gradients_equal_without_input_require_grads(policy: object) -> None:
    reference = copy.deepcopy(_peft_model())
    expected = _lora_grads(reference)
    assert len(expected) == 4 * 3 * 2  # A and B of three targets in four layers
    model = copy.deepcopy(_peft_model())
    plan = apply_activation_checkpointing(model, policy)
    assert plan.num_checkpointed == (2 if isinstance(policy, dict) else 4)
    assert plan.layers[0].name == "base_model.model.model.layers.0"
    embedding = model.get_input_embeddings()
    assert not embedding.weight.requires_grad
    assert not embedding(batch()).requires_grad  # no enable_input_require_grads ritual was needed
    actual = _lora_grads(model)
    assert_same_grads(expected, actual)
    assert all(g.abs().sum() > 0 for g in actual.values())
