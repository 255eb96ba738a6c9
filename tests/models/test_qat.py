"""Quantization-aware training through torchao (`remat.models.qat`, the recipe's ``qat`` section): the linear layers
become fake-quantising ones; every checkpointing policy's gradients equal the un-checkpointed QAT step's bit for bit;
``fake_quant_after_n_steps`` trains the first steps exactly as without QAT; the estimate equals the logged ``mem``; the
export loads as the plain model; the rules between sections, and NeMo's ``qat`` section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import recipe_step_gradients, tiny_recipe

from remat.errors import ConfigError
from remat.recipes.loader import validate_recipe

pytest.importorskip("torchao", reason="QAT needs torchao (the test extra installs it)")

QAT = {"enabled": True, "quantizer_type": "int8_dynact_int4weight", "groupsize": 32}


def _recipe(tmp_path: Path, policy: Any = "none", **sections: Any) -> Any:
    return validate_recipe(tiny_recipe(**{
        "output_dir": str(tmp_path / "run"), "step_scheduler": {"max_steps": 4}, "checkpoint": {"enabled": False},
        "logging": {"memory": "tracked", "metrics_file": None}, "distributed": {"activation_checkpointing": policy},
        "qat": QAT, **sections}))


def test_the_linear_layers_fake_quantise_and_a_groupsize_that_fits_none_is_one_line(tmp_path: Path) -> None:
    from remat.recipes.build import build_recipe_model

    model = build_recipe_model(_recipe(tmp_path), vocab_size=None)
    kinds = {type(module).__name__ for name, module in model.named_modules() if name.endswith(("q_proj", "down_proj"))}
    assert kinds == {"Int8DynActInt4WeightQATLinear"}
    with pytest.raises(ConfigError, match=r"^qat.groupsize: 96 divides the input features of no linear layer of "):
        build_recipe_model(_recipe(tmp_path, qat={**QAT, "groupsize": 96}), vocab_size=None)


#: A tiny model whose every linear layer has 128 input features or more (torchao's int4 weight-only layout).
WIDE = {"preset": "tiny-llama", "config": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                                           "num_attention_heads": 4, "num_key_value_heads": 2}}


@pytest.mark.parametrize("quantizer", ["int8_dynact_int4weight", "int4_weight_only"])
@pytest.mark.parametrize("policy", ["full", "selective", {"mode": "full", "every_n_layers": 2}])
def test_every_policy_s_qat_gradients_equal_the_uncheckpointed_qat_step(policy: Any, quantizer: str,
                                                                        tmp_path: Path) -> None:
    qat = {**QAT, "quantizer_type": quantizer}
    model = WIDE if quantizer == "int4_weight_only" else {}
    loss, grads = recipe_step_gradients(_recipe(tmp_path, "none", qat=qat, model=model))
    checkpointed_loss, checkpointed = recipe_step_gradients(_recipe(tmp_path, policy, qat=qat, model=model))
    assert checkpointed_loss == loss and grads.keys() == checkpointed.keys() and len(grads) > 10
    assert all(torch.equal(grads[name], checkpointed[name]) for name in grads)
    plain_loss, _ = recipe_step_gradients(_recipe(tmp_path, "none", qat={"enabled": False}, model=model))
    assert plain_loss != loss  # the fake quantisation is in the step
    if quantizer == "int4_weight_only":
        with pytest.raises(ConfigError, match=r"^qat.quantizer_type: int4_weight_only needs every linear layer's "
                                              r"input features to be a multiple of 128 .*; model.layers.0.self_attn"):
            recipe_step_gradients(_recipe(tmp_path, "none", qat=qat))  # hidden size 64


def test_fake_quantisation_starts_after_n_steps_and_the_export_is_the_plain_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from remat.recipes.finetune import FinetuneRecipe

    plain = FinetuneRecipe(_recipe(tmp_path / "plain", qat={"enabled": False})).run()
    delayed_job = FinetuneRecipe(_recipe(tmp_path / "qat", qat={**QAT, "fake_quant_after_n_steps": 2},
                                         checkpoint={"enabled": True}))
    delayed = delayed_job.run()
    losses = [[record.loss for record in run.records] for run in (plain, delayed)]
    assert losses[1][:2] == losses[0][:2] and losses[1][2] != losses[0][2], losses  # steps 1-2 full precision
    export = tmp_path / "qat" / "run" / "checkpoints" / "step_4" / "model"
    loaded = AutoModelForCausalLM.from_pretrained(export)
    trained = dict(delayed_job.model.named_parameters())
    for name, param in loaded.named_parameters():
        assert torch.equal(param, trained[name].detach()), name


@pytest.mark.parametrize("policy", ["none", "full"])
def test_the_estimate_of_a_qat_recipe_equals_its_logged_mem(policy: str, tmp_path: Path) -> None:
    from remat import estimate_memory
    from remat.estimate.api import settings_from_recipe
    from remat.recipes.finetune import FinetuneRecipe

    cfg = _recipe(tmp_path, policy, step_scheduler={"max_steps": 2})
    model, settings = settings_from_recipe(cfg, target="cpu", documents_per_row=2)
    estimate = estimate_memory(model, settings)
    measured = FinetuneRecipe(cfg).run().records[-1].mem_bytes
    assert estimate.peak_bytes == measured, (estimate.peak_bytes, measured)


@pytest.mark.parametrize(("sections", "key"), [({"fp8": {"enabled": True, "emulate": True}}, "fp8.enabled"),
                                               ({"peft": {"r": 4}}, "peft")])
def test_qat_with_another_treatment_of_the_weights_is_one_line(sections: dict[str, Any], key: str,
                                                                tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"^qat.enabled with {key}; quantization-aware training fake-quantises"):
        _recipe(tmp_path, **sections)


def test_nemo_s_qat_section_is_remat_s() -> None:
    from remat.recipes.nemo import from_nemo

    out, said = from_nemo({"rng": {"seed": 1}, "qat": {
        "enabled": True, "fake_quant_after_n_steps": 1,
        "qat_config": {"_target_": "nemo_automodel.components.quantization.qat.QATConfig",
                       "quantizer_type": "int8_dynact_int4weight", "groupsize": 256}}})
    assert out["qat"] == {"enabled": True, "fake_quant_after_n_steps": 1, "quantizer_type": "int8_dynact_int4weight",
                          "groupsize": 256}
    assert any(line.startswith("qat (NeMo's QATConfig) -> qat: torchao's fake-quantising") for line in said)
