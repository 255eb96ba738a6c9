"""With ``tiled: true`` the final norm (after the last block) runs over chunks of the tokens too.

Llama's RMSNorm upcasts to fp32 and keeps for backward a fp32 ``[tokens, hidden]`` copy and the bf16 normalised
hidden states: at 1M tokens of the Llama-3.2-1B shape that is 12 GiB outside the blocks. Tiled, it keeps only its
input (the last block's output, which exists anyway) and recomputes one chunk at a time in backward.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from ckpt_models import ARCHS, batch, step_grads, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from remat.checkpointing import apply_activation_checkpointing
from remat.checkpointing.discovery import find_blocks
from remat.checkpointing.discovery import find_final_norms
from remat.checkpointing.wrappers import is_wrapped, unwrap_forward
from remat.memory import LiveTensorTracker

FINAL_NORM = {"llama": "model.norm", "gpt2": "transformer.ln_f", "gpt_neox": "gpt_neox.final_layer_norm",
              "gemma3n_text": "model.norm"}


@pytest.mark.parametrize("arch", sorted(FINAL_NORM))
def test_the_final_norm_is_the_first_norm_after_the_blocks(arch: str) -> None:
    model = tiny_model(arch)
    assert find_final_norms(model, find_blocks(model)) == (FINAL_NORM[arch],)


def test_tiled_plan_wraps_the_final_norm_and_says_so() -> None:
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = apply_activation_checkpointing(model, {"mode": "full", "tiled": True, "tile_tokens": 5})
    assert plan.tiled_outside == ("model.norm",)
    assert plan.wrapped_modules[-1] == "model.norm" and is_wrapped(model.model.norm)
    assert any("final norm (model.norm)" in note for note in plan.notes)
    untiled = apply_activation_checkpointing(tiny_model("llama"), "full")
    assert untiled.tiled_outside == () and "model.norm" not in untiled.wrapped_modules


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_gradients_with_the_tiled_final_norm_equal_untiled(arch: str) -> None:
    ids = batch()
    expected = step_grads(tiny_model(arch), ids)
    model = tiny_model(arch)
    plan = apply_activation_checkpointing(model, {"mode": "mlp", "tiled": True, "tile_tokens": 7})
    assert plan.tiled_outside == (FINAL_NORM[arch],)
    actual = step_grads(model, ids)
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m, n=name: f"{n}: {m}")


def _bf16_llama(seq: int) -> tuple[torch.nn.Module, torch.Tensor]:
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model, torch.randint(0, 64, (1, seq))


def _saved_after_decoder(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes alive after the decoder's forward (what autograd keeps for backward, plus the output)."""
    with LiveTensorTracker(module=model) as tracker:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        alive = tracker.current_bytes
        hidden.float().sum().backward()
    return alive


def test_the_tiled_final_norm_keeps_no_full_length_fp32_copy() -> None:
    """Untiled, Llama's final RMSNorm keeps for backward its fp32 input copy (4 bytes x hidden per token), the bf16
    cast of the normalised states (2 x hidden) and the [T, 1] fp32 reciprocal root; tiled, it keeps chunk views of
    its input only."""
    seq, hidden = 512, 64
    tiled = {"mode": "full", "tiled": True, "tile_tokens": 64}
    model, ids = _bf16_llama(seq)
    apply_activation_checkpointing(model, tiled)
    with_tiling = _saved_after_decoder(model, ids)
    assert unwrap_forward(model.model.norm)
    without = _saved_after_decoder(model, ids)
    per_token = (without - with_tiling) / seq
    assert per_token >= (4 + 2) * hidden + 4


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in ("mixtral", "qwen3_moe")])
def test_every_dense_arch_tiles_its_final_norm(arch: str) -> None:
    model = tiny_model(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = apply_activation_checkpointing(model, {"mode": "full", "tiled": True})
    assert len(plan.tiled_outside) == 1 and is_wrapped(dict(model.named_modules())[plan.tiled_outside[0]])
