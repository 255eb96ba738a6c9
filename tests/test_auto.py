"""``remat.AutoModelForCausalLM`` in one process: every source (local checkpoint, preset, transformers config,
mapping), checkpointing applied exactly once with the plan attached, gradients equal to the plain model's, and one
clear error per misuse. The 2-rank DDP / FSDP2 cases are in tests/distributed/test_auto_model.py."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoConfig, PreTrainedModel
from transformers import AutoModelForCausalLM as HFAutoModelForCausalLM

import remat
from remat.auto import PLAN_ATTRIBUTE
from remat.checkpointing.wrappers import STATE_ATTR
from remat.errors import CheckpointingError, ConfigError

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local pretrained directory (config.json + safetensors) of a 3-layer Llama."""
    torch.manual_seed(0)
    model = HFAutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))
    path = tmp_path_factory.mktemp("tiny-llama-checkpoint")
    model.save_pretrained(path)
    return path


def wrapped_blocks(model: nn.Module) -> int:
    return sum(hasattr(module, STATE_ATTR) for module in model.modules())


def loss_and_grads(model: nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_step(model: nn.Module, reference: nn.Module) -> None:
    loss, grads = loss_and_grads(model)
    expected_loss, expected = loss_and_grads(reference)
    assert loss == expected_loss
    assert grads.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("policy", [True, "selective", "sqrt"], ids=str)
def test_local_checkpoint_with_a_single_setup(checkpoint_dir: Path, policy: object) -> None:
    reference = HFAutoModelForCausalLM.from_pretrained(checkpoint_dir).train()
    setup = remat.DistributedSetup.build(strategy="single", activation_checkpointing=policy)
    model = remat.AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), distributed_setup=setup)
    assert isinstance(model, PreTrainedModel) and model.training and model.config.use_cache is False
    plan = getattr(model, PLAN_ATTRIBUTE)
    assert plan is model.remat_plan is setup.plan and setup.root is model
    assert plan.num_checkpointed == 3 and wrapped_blocks(model) == len(plan.wrapped_modules) == 3
    assert_same_step(model, reference)


def test_preset_with_checkpointing_and_config_overrides() -> None:
    torch.manual_seed(1)
    model = remat.AutoModelForCausalLM.from_pretrained("Tiny-Llama", activation_checkpointing="full",
                                                       num_hidden_layers=2, dtype=torch.float32)
    torch.manual_seed(1)
    reference = remat.build_model(remat.ModelConfig(preset="tiny-llama", config={"num_hidden_layers": 2}))
    assert model.config.num_hidden_layers == 2 and wrapped_blocks(model) == 2
    assert model.remat_plan.summary().startswith("full: 2/2 blocks")
    assert_same_step(model, reference)


def test_no_setup_and_no_checkpointing_gives_the_plain_model(checkpoint_dir: Path) -> None:
    model = remat.AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype="bfloat16")
    assert wrapped_blocks(model) == 0 and model.remat_plan.num_checkpointed == 0
    assert next(model.parameters()).dtype == torch.bfloat16


def test_from_config_takes_a_transformers_config_a_mapping_or_a_model_config() -> None:
    config = AutoConfig.for_model("qwen3", head_dim=8, **TINY)
    torch.manual_seed(2)
    model = remat.AutoModelForCausalLM.from_config(config, activation_checkpointing="mlp")
    torch.manual_seed(2)
    reference = HFAutoModelForCausalLM.from_config(copy.deepcopy(config)).train()
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.remat_plan.modes() == {"mlp": 3}
    assert config.use_cache is True, "the caller's config is left as it was"
    assert_same_step(model, reference)
    mapping = remat.AutoModelForCausalLM.from_config({"model_type": "llama", **TINY}, activation_checkpointing=True)
    assert wrapped_blocks(mapping) == 3
    typed = remat.AutoModelForCausalLM.from_config(remat.ModelConfig(preset="tiny-llama"), dtype="bfloat16")
    assert next(typed.parameters()).dtype == torch.bfloat16 and typed.remat_plan.num_checkpointed == 0


def test_checkpointing_is_applied_once(checkpoint_dir: Path) -> None:
    setup = remat.DistributedSetup.build(strategy="single", activation_checkpointing="full")
    model = remat.AutoModelForCausalLM.from_pretrained(checkpoint_dir, distributed_setup=setup)
    with pytest.raises(CheckpointingError, match="already applied to LlamaForCausalLM by remat"):
        remat.apply_activation_checkpointing(model, "full")
    with pytest.raises(ConfigError, match="^distributed_setup: this DistributedSetup already parallelized a model"):
        remat.AutoModelForCausalLM.from_pretrained(checkpoint_dir, distributed_setup=setup)
    assert wrapped_blocks(model) == 3


@pytest.mark.parametrize(("call", "message"), [
    (lambda: remat.AutoModelForCausalLM.from_pretrained("./missing/model"),
     "model.pretrained_model_name_or_path: './missing/model' is neither a local directory nor a Hub id"),
    (lambda: remat.AutoModelForCausalLM.from_pretrained("tiny-llama", dtype="int8"),
     "dtype: Input should be 'float32', 'bfloat16', 'float16' or 'auto' (got 'int8')"),
    (lambda: remat.AutoModelForCausalLM.from_pretrained("tiny-llama", activation_checkpointing="sometimes"),
     "activation_checkpointing: got 'sometimes'; allowed:"),
    (lambda: remat.AutoModelForCausalLM.from_pretrained(
        "tiny-llama", activation_checkpointing="full",
        distributed_setup=remat.DistributedSetup.build(strategy="single")),
     "activation_checkpointing: given next to distributed_setup; give it once"),
    (lambda: remat.AutoModelForCausalLM.from_config({"model_type": "llama"}, revision="main"),
     "from_config: unexpected keyword argument(s) revision; allowed: dtype"),
    (lambda: remat.AutoModelForCausalLM.from_config(AutoConfig.for_model("vit")),
     "config: ViTConfig has no causal-LM class"),
    (lambda: remat.AutoModelForCausalLM.from_config(remat.ModelConfig(preset="tiny-llama"), dtype="int8"),
     "dtype: Input should be 'float32', 'bfloat16', 'float16' or 'auto' (got 'int8')"),
    (lambda: remat.AutoModelForCausalLM.from_pretrained("tiny-llama", num_hiden_layers=2),
     "model.config.num_hiden_layers: LlamaConfig ('llama') has no such field"),
    (lambda: remat.AutoModelForCausalLM.from_config(["llama"]),  # type: ignore[arg-type]
     "from_config: config must be a transformers PretrainedConfig, a mapping"),
])
def test_misuse_gets_one_line_naming_the_argument(call: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        call()  # type: ignore[operator]
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_class_is_not_instantiated() -> None:
    with pytest.raises(TypeError, match="use AutoModelForCausalLM.from_pretrained"):
        remat.AutoModelForCausalLM()
