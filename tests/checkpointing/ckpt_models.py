"""Helpers of the checkpointing tests: tiny models of many architectures built from configs (nothing downloaded),
a batch, and gradient comparison."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import torch
from torch import nn

VOCAB = 128
SEQ = 16
BATCH = 2

_COMMON: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=64, attention_dropout=0.1,
)
# Per architecture: config overrides (dropout switched on wherever the config has it).
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": dict(head_dim=8),
    "mistral": {},
    "gemma2": dict(head_dim=8, attn_implementation="eager"),
    "gpt2": dict(n_embd=32, n_layer=4, n_head=4, n_positions=64, vocab_size=VOCAB, resid_pdrop=0.1, embd_pdrop=0.1,
                 attn_pdrop=0.1, bos_token_id=0, eos_token_id=0),
    "gpt_neox": dict(hidden_dropout=0.1, eos_token_id=0, bos_token_id=0),
    "phi3": dict(pad_token_id=0, eos_token_id=0, bos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8),
    "gemma3n_text": dict(
        num_kv_shared_layers=2, head_dim=8, hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2,
        intermediate_size=[64] * 4, layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.0] * 4, vocab_size_per_layer_input=VOCAB,
    ),
}
NUM_LAYERS = 4


@functools.cache
def _prototype(arch: str, num_layers: int) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = dict(ARCHS[arch])
    kwargs = {} if arch == "gpt2" else dict(_COMMON)
    kwargs.update(overrides)
    if arch == "gpt2":
        kwargs["n_layer"] = num_layers
    else:
        kwargs["num_hidden_layers"] = num_layers
    if arch == "gemma3n_text":
        kwargs["intermediate_size"] = [64] * num_layers
        kwargs["layer_types"] = (["sliding_attention", "full_attention"] * num_layers)[:num_layers]
        kwargs["activation_sparsity_pattern"] = [0.0] * num_layers
        kwargs["num_kv_shared_layers"] = min(2, num_layers - 2) if num_layers > 2 else 0
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kwargs))
    return model


def tiny_model(arch: str, num_layers: int = NUM_LAYERS) -> nn.Module:
    """A fresh copy of a tiny, deterministic-weight model of ``arch`` in training mode."""
    model = copy.deepcopy(_prototype(arch, num_layers))
    model.train()
    return model


def batch(seed: int = 1) -> torch.Tensor:
    """Token ids avoiding the special ids 0-2 (gemma3n's altup norm is 0/0 on an all-zero padding embedding)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)


def step_grads(model: nn.Module, ids: torch.Tensor, *, seed: int = 123) -> dict[str, torch.Tensor]:
    """Gradients of one forward/backward of the LM loss, with the RNG seeded (dropout masks reproducible)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    assert expected, "no gradients at all"
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
