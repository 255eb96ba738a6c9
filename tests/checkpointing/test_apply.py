"""Applying a policy: names and saved weights unchanged, no double wrapping, use_cache, fallbacks and warnings said,
errors for policies that wrap nothing, undo, eval / no_grad pass-through, deepcopy."""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import transformers
from ckpt_models import assert_same_grads, batch, step_grads, tiny_model
from custom_models import MixerLM, NoStack, TinyLM, lm_loss
from torch import nn

from remat.checkpointing import (
    CheckpointingWarning,
    CheckpointPolicy,
    apply_activation_checkpointing,
    is_checkpointed,
    remove_activation_checkpointing,
)
from remat.checkpointing.wrappers import wrap_state
from remat.errors import CheckpointingError, ConfigError


@pytest.mark.parametrize("policy", ["full", "mlp", "sqrt", "selective"])
def test_names_state_dict_and_saved_weights_unchanged(policy: str, tmp_path) -> None:
    from safetensors.torch import load_file

    model = tiny_model("llama")
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    model.save_pretrained(tmp_path / "before")
    apply_activation_checkpointing(model, policy)
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    model.save_pretrained(tmp_path / "after")
    before = load_file(tmp_path / "before" / "model.safetensors")
    after = load_file(tmp_path / "after" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the block modules are the same objects, still in their ModuleList (fully_shard / compile can target them)
    assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in model.model.layers)


def test_applying_twice_is_refused() -> None:
    model = tiny_model("llama")
    apply_activation_checkpointing(model, "full")
    with pytest.raises(CheckpointingError) as info:
        apply_activation_checkpointing(model, "selective")
    message = str(info.value)
    assert "already applied to LlamaForCausalLM by remat (4 modules, e.g. 'model.layers.0')" in message
    assert "remove_activation_checkpointing(model)" in message


@pytest.mark.parametrize("enable", ["activation_checkpointing_enable", "gradient_checkpointing_enable"])
def test_transformers_own_checkpointing_is_refused(enable: str) -> None:
    model = tiny_model("qwen2")
    if not hasattr(model, enable):
        pytest.skip(f"transformers {transformers.__version__} has no {enable}() (added after 5.17)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        getattr(model, enable)()
    with pytest.raises(CheckpointingError) as info:
        apply_activation_checkpointing(model, "full")
    message = str(info.value)
    assert "transformers' own activation checkpointing is already on in Qwen2ForCausalLM" in message
    disable = "activation_checkpointing_disable" if hasattr(model, "activation_checkpointing_disable") \
        else "gradient_checkpointing_disable"
    assert f"Call model.{disable}() first" in message  # the method this transformers has
    getattr(model, disable)()
    assert apply_activation_checkpointing(model, "full").num_checkpointed == 4


def test_torch_checkpoint_wrapper_is_refused() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = TinyLM()
    model.trunk.blocks[0] = checkpoint_wrapper(model.trunk.blocks[0])
    with pytest.raises(CheckpointingError, match="already has torch checkpoint_wrapper modules"):
        apply_activation_checkpointing(model, "full")


def test_remove_restores_forward_and_use_cache_then_reapply() -> None:
    model = tiny_model("llama")
    assert model.config.use_cache is True
    plan = apply_activation_checkpointing(model, "full")
    assert model.config.use_cache is False
    assert any("use_cache set to False on LlamaConfig (<root>)" in note for note in plan.notes)
    assert "forward" in model.model.layers[0].__dict__
    assert remove_activation_checkpointing(model) == 4
    assert model.config.use_cache is True
    assert not is_checkpointed(model) and "forward" not in model.model.layers[0].__dict__
    assert remove_activation_checkpointing(model) == 0
    assert apply_activation_checkpointing(model, "mlp").num_checkpointed == 4


def test_none_returns_an_empty_plan_and_touches_nothing() -> None:
    model = tiny_model("llama")
    for value in ("none", False, None, {"mode": "none"}):
        plan = apply_activation_checkpointing(model, value)
        assert plan.layers == () and plan.num_checkpointed == 0
        assert plan.summary() == "none: nothing wrapped in LlamaForCausalLM"
    assert model.config.use_cache is True and not is_checkpointed(model)
    # also for models without blocks: nothing is searched
    assert apply_activation_checkpointing(NoStack(), False).layers == ()


def test_policies_that_wrap_nothing_are_errors() -> None:
    with pytest.raises(CheckpointingError, match=r"every_n_layers: got 5, but the model has only 4 blocks; allowed"):
        apply_activation_checkpointing(tiny_model("llama"), {"every_n_layers": 5})
    with pytest.raises(CheckpointingError, match=r"layers: the key '3-6' names a block past the last one; .* 4 blocks"):
        apply_activation_checkpointing(tiny_model("llama"), {"layers": {"3-6": "mlp"}})
    with pytest.raises(CheckpointingError, match=r"segments: got 5, more segments than the model's 4 blocks"):
        apply_activation_checkpointing(tiny_model("llama"), {"segments": 5})
    with pytest.raises(CheckpointingError, match=r"wraps nothing in LlamaForCausalLM.*layers\['0-3'\]"):
        apply_activation_checkpointing(tiny_model("llama"), {"mode": "full", "layers": {"0-3": "none"}})
    with pytest.raises(CheckpointingError) as info:
        apply_activation_checkpointing(MixerLM(), "attention")
    message = str(info.value)
    assert "policy mode 'attention': no attention sub-module found in block 0 (layers.0, MixerBlock)" in message
    assert "Children are: token_mix" in message
    with pytest.raises(CheckpointingError, match="no transformer blocks found in NoStack"):
        apply_activation_checkpointing(NoStack(), "full")
    with pytest.raises(ConfigError, match="options: unknown key 'every_n'"):
        apply_activation_checkpointing(tiny_model("llama"), "full", every_n=2)
    assert not is_checkpointed(MixerLM())


def test_options_override_policy_fields() -> None:
    plan = apply_activation_checkpointing(tiny_model("llama"), "selective", every_n_layers=2)
    assert plan.policy == CheckpointPolicy("selective", every_n_layers=2)
    assert [layer.mode for layer in plan] == ["selective", "none", "selective", "none"]
    assert plan.layers[1].note == "every_n_layers=2: not selected"


def test_kv_sharing_producers_fall_back_to_mlp_with_warning_and_plan_entry() -> None:
    model = tiny_model("gemma3n_text")
    with pytest.warns(CheckpointingWarning, match=r"2 KV-sharing producer blocks \(0, 1\) keep their attention"):
        plan = apply_activation_checkpointing(model, "full")
    assert [(layer.requested, layer.mode) for layer in plan] == [("full", "mlp")] * 2 + [("full", "full")] * 2
    assert plan.layers[0].wrapped == ("model.layers.0.mlp",)
    assert "KV-sharing producer" in plan.layers[0].note
    assert plan.fallbacks == plan.layers[:2]
    assert "2 fallbacks" in plan.summary()


def test_selective_on_moe_warns_why() -> None:
    with pytest.warns(CheckpointingWarning, match="selective checkpointing on 4 mixture-of-experts blocks") as record:
        plan = apply_activation_checkpointing(tiny_model("qwen3_moe"), "selective")
    assert "full is the usual choice" in str(record[0].message) and "router's topk is saved" in str(record[0].message)
    assert all("MoE block" in layer.note for layer in plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointingWarning)
        apply_activation_checkpointing(tiny_model("qwen3_moe"), "full")  # full on MoE: nothing to warn about


def test_a_kv_cache_passed_while_training_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model("mistral")
    ids = batch()
    expected = step_grads(model, ids)
    apply_activation_checkpointing(model, "full")
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    with caplog.at_level(logging.WARNING, logger="remat.checkpointing.wrappers"):
        out = model(input_ids=ids, labels=ids, use_cache=True)  # asks for a cache: every block would write it twice
        out.loss.backward()
    assert "must not update a KV cache" in caplog.text
    assert out.past_key_values is None or out.past_key_values.get_seq_length() == 0
    assert_same_grads(expected, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})


def test_eval_and_no_grad_run_the_original_forward() -> None:
    model = tiny_model("llama")
    ids = batch()
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    apply_activation_checkpointing(model, "full")
    calls = []
    model.model.layers[0].mlp.register_forward_hook(lambda *_: calls.append(1))
    logits = model(input_ids=ids).logits  # eval with grad: no checkpoint, nothing recomputed
    logits.sum().backward()
    assert len(calls) == 1
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected)


def test_custom_model_gradients_and_deepcopy() -> None:
    torch.manual_seed(0)
    model = TinyLM()
    ids = torch.randint(0, 64, (2, 12))

    def grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
        m.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        lm_loss(m, ids).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    expected = grads(model)
    for policy in ("full", "attention", "mlp", "sqrt", {"block_pattern": r"trunk\.blocks\.[02]"}):
        candidate = copy.deepcopy(model)
        apply_activation_checkpointing(candidate, policy)
        assert_same_grads(expected, grads(candidate))
        twin = copy.deepcopy(candidate)  # an independent wrapped copy: its wrappers call its own modules
        states = [(m, wrap_state(m)) for m in twin.modules() if wrap_state(m) is not None]
        assert states and all(state.inner.__self__ is m for m, state in states)
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(0.5)
        assert_same_grads(expected, grads(candidate))  # halving the twin's weights did not touch the original
        assert is_checkpointed(twin)


class _IndexedAttention(nn.Module):
    """A block whose attention is a ModuleList of two halves that it indexes: the wrapped list never runs."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn[1](self.attn[0](x))
        return x + self.mlp(x)


def test_a_wrapped_module_the_block_never_calls_is_an_error_on_the_first_forward() -> None:
    model = nn.Module()
    model.layers = nn.ModuleList(_IndexedAttention(8) for _ in range(2))
    plan = apply_activation_checkpointing(model, "attention")
    assert plan.wrapped_modules == ("layers.0.attn", "layers.1.attn")
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(CheckpointingError, match=r"policy 'attention' wrapped layers.0.attn, but layers.0 ran "
                                                 r"without calling it .*nothing would be recomputed there"):
        model.layers[0](x)
    # A block that calls what was wrapped passes, once; the hooks are gone after its first forward.
    model2 = TinyLM(layers=2)
    apply_activation_checkpointing(model2, "attention")
    model2(torch.randint(0, 64, (2, 8))).sum().backward()
    assert all(not block._forward_hooks and not block.attn._forward_pre_hooks for block in model2.trunk.blocks)
