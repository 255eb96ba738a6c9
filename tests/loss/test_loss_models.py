"""The fused loss on real model heads: Hugging Face models, tied/softcapped/scaled heads, DTensor weights, mistakes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from loss_reference import reference_loss
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from remat.checkpointing.hf_native import enable_hf_checkpointing, is_hf_checkpointing
from remat.errors import ConfigError
from remat.loss import FusedLinearCrossEntropy, MaskedCrossEntropy, output_head
from remat.loss.head import OutputHead

VOCAB = 53


def _model(model_type: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    config = AutoConfig.for_model(model_type, **{**shape, **overrides})
    return AutoModelForCausalLM.from_config(config).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=generator)
    labels = ids.masked_fill(torch.arange(12) < 4, -100)  # a masked prompt
    return ids, labels


def _fused_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    head = output_head(model)
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    loss_fn = FusedLinearCrossEntropy(logit_softcap=head.logit_softcap, chunk_size=5)
    return loss_fn(hidden * head.hidden_scale, head.weight, labels, bias=head.bias)


@pytest.mark.parametrize(
    ("model_type", "overrides", "expected_head"),
    [
        ("llama", {}, (None, 1.0, False)),
        ("gemma2", {"attn_implementation": "eager"}, (30.0, 1.0, True)),  # soft-capped, tied embeddings
        ("granite", {"logits_scaling": 4.0}, (None, 0.25, False)),
        ("cohere", {"logit_scale": 0.5}, (None, 0.5, True)),
    ],
)
def test_loss_and_every_parameter_gradient_equal_the_models_own(model_type, overrides, expected_head) -> None:
    model = _model(model_type, **overrides)
    head = output_head(model)
    tied = head.weight is model.get_input_embeddings().weight
    assert (head.logit_softcap, head.hidden_scale, tied) == expected_head
    ids, labels = _batch()
    out = model(input_ids=ids, labels=labels)  # HF's own loss (computed in fp32)
    plain = MaskedCrossEntropy()(out.logits, labels)  # the same loss in float64
    plain.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = _fused_loss(model, ids, labels)
    loss.backward()
    torch.testing.assert_close(loss, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss.float(), out.loss, rtol=1e-6, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)


def test_lora_on_the_body_keeps_the_head_usable_and_lora_on_the_head_is_refused() -> None:
    ids, labels = _batch()
    body = get_peft_model(_model("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    expected = MaskedCrossEntropy()(body(input_ids=ids).logits, labels)
    torch.testing.assert_close(_fused_loss(body, ids, labels), expected, rtol=1e-12, atol=1e-12)
    with_head = get_peft_model(_model("llama"), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ConfigError, match="keep lm_head out of LoRA target_modules"):
        output_head(with_head)


def test_models_without_a_usable_head_are_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="has no get_output_embeddings"):
        output_head(nn.Linear(3, 4))
    hyper_scaled = _model("llama")
    hyper_scaled.config.logit_scale = 2.0  # a scaling remat does not know for this model type
    with pytest.raises(ConfigError, match=r"model_type 'llama' sets logit_scale=2.0"):
        output_head(hyper_scaled)
    biased = _model("granite", logits_scaling=4.0)
    biased.lm_head = nn.Linear(16, VOCAB, bias=True).double()
    with pytest.raises(ConfigError, match="head with a bias"):
        output_head(biased)
    assert isinstance(output_head(_model("llama")), OutputHead)


def test_dtensor_weight_gets_a_dtensor_gradient_equal_to_the_plain_one() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        hidden, weight = torch.randn(2, 7, 6, dtype=torch.float64), torch.randn(19, 6, dtype=torch.float64)
        labels = torch.randint(0, 19, (2, 7))
        sharded = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
        loss = FusedLinearCrossEntropy(chunk_size=3)(hidden, sharded, labels)
        loss.backward()
        plain = weight.clone().requires_grad_()
        reference_loss(hidden, plain, labels).backward()
        assert isinstance(sharded.grad, DTensor)
        torch.testing.assert_close(sharded.grad.full_tensor(), plain.grad, rtol=1e-12, atol=1e-14)
    finally:
        if started_here:
            dist.destroy_process_group()


@pytest.mark.parametrize(
    ("build", "call", "message"),
    [
        (dict(reduction="none"), None, "loss_fn.reduction: got 'none'"),
        (dict(logit_softcap=0.0), None, "loss_fn.logit_softcap: got 0.0"),
        (dict(chunk_size=0), None, "loss_fn.chunk_size: got 0"),
        (dict(grad_strategy="lazy"), None, "loss_fn.grad_strategy: got 'lazy'"),
        (dict(chunk_bytes=-1), None, "loss_fn.chunk_bytes: got -1"),
        ({}, dict(weight=torch.randn(7, 5)), r"lm_head_weight: got shape \(7, 5\); allowed: \[vocab, 4\]"),
        ({}, dict(weight=torch.randn(7, 4, dtype=torch.float64)), "lm_head_weight: got dtype torch.float64"),
        ({}, dict(bias=torch.randn(6)), r"bias: got shape \(6,\); allowed: None or \[7\]"),
        ({}, dict(labels=torch.zeros(2, 4, dtype=torch.long)), r"labels: got shape \(2, 4\)"),
        ({}, dict(labels=torch.full((2, 3), 7)), "labels: got token id 7"),
        ({}, dict(hidden=torch.randn(4)), r"hidden_states: got shape \(4,\)"),
        (dict(reduction="sum"), dict(num_label_tokens=3), "num_label_tokens: got 3 with loss_fn.reduction='sum'"),
        ({}, dict(num_label_tokens=-2), "num_label_tokens: got -2"),
    ],
)
def test_mistakes_raise_config_errors_naming_the_argument(build, call, message) -> None:
    inputs = dict(hidden=torch.randn(2, 3, 4), weight=torch.randn(7, 4), labels=torch.ones(2, 3, dtype=torch.long),
                  bias=None, num_label_tokens=None)
    with pytest.raises(ConfigError, match=message):
        loss_fn = FusedLinearCrossEntropy(**build)
        inputs.update(call or {})
        loss_fn(inputs["hidden"], inputs["weight"], inputs["labels"], bias=inputs["bias"],
                num_label_tokens=inputs["num_label_tokens"])


def test_composes_with_activation_checkpointing_of_the_decoder_layers() -> None:
    ids, labels = _batch()
    plain_model, checkpointed = _model("llama", num_hidden_layers=2), _model("llama", num_hidden_layers=2)
    enable_hf_checkpointing(checkpointed)
    checkpointed.config.use_cache = plain_model.config.use_cache = False
    for model in (plain_model, checkpointed):
        model.train()
        _fused_loss(model, ids, labels).backward()
    assert is_hf_checkpointing(checkpointed) and not is_hf_checkpointing(plain_model)
    for (name, param), other in zip(plain_model.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(other.grad, param.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_dtensor_weight_sharded_over_several_ranks_is_refused() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("needs its own (fake) process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        sharded = distribute_tensor(torch.randn(20, 6), mesh, [Shard(0)])
        with pytest.raises(ConfigError, match=r"DTensor sharded as \[Shard\(dim=0\)\] over 2 ranks"):
            FusedLinearCrossEntropy()(torch.randn(2, 7, 6), sharded, torch.randint(0, 20, (2, 7)))
    finally:
        dist.destroy_process_group()
