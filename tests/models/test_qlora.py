"""QLoRA (``model.quantization``, `remat.models.quantization`): a pretrained checkpoint's linear layers load as 4-bit
bitsandbytes layers (NF4, double quantisation) and LoRA adapters train over them, on the CPU; every checkpointing
policy's adapter gradients equal the un-checkpointed step's bit for bit; a crashed run resumes the same curve; the
``model/`` export is the dequantised base with the adapter merged, a float model whose logits are the trained
model's; the rules between keys, the estimate's refusal, and NeMo's ``quantization`` section."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import recipe_step_gradients, tiny_causal_lm, tiny_recipe

from remat.errors import ConfigError
from remat.recipes.loader import validate_recipe

pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (the test extra installs it)")

QUANTIZATION = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved as a pretrained checkpoint (the builtin tokenizer's 512 tokens)."""
    directory = tmp_path_factory.mktemp("qlora") / "base"
    tiny_causal_lm(vocab_size=512).save_pretrained(directory)
    return directory


def _recipe(base: Path, out: Path, policy: Any = "none", **sections: Any) -> dict[str, Any]:
    recipe = tiny_recipe(**{"output_dir": str(out), "dataset": {"seq_length": 32}, "peft": {"r": 4, "lora_alpha": 8},
                            "step_scheduler": {"max_steps": 4, "ckpt_every_steps": 2}, "checkpoint": {"enabled": True},
                            "logging": {"metrics_file": None}, "distributed": {"activation_checkpointing": policy},
                            **sections})
    recipe["model"] = {"pretrained_model_name_or_path": str(base), "quantization": dict(QUANTIZATION)}
    return recipe


def test_the_linear_layers_load_as_4_bit_and_the_adapters_train(base: Path, tmp_path: Path) -> None:
    from remat.recipes.finetune import FinetuneRecipe

    job = FinetuneRecipe(validate_recipe(_recipe(base, tmp_path / "run")))
    result = job.run()
    assert [r.step for r in result.records] == [1, 2, 3, 4] and all(r.loss == r.loss for r in result.records)
    kinds = {type(m).__name__ for name, m in job.model.named_modules() if name.endswith("q_proj.base_layer")}
    assert kinds == {"Linear4bit"}
    assert type(job.model.get_base_model().lm_head).__name__ == "Linear"  # the output head stays in model.dtype
    trained = {n: p for n, p in job.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in name for name in trained)
    assert all(p.abs().sum() > 0 for name, p in trained.items() if ".lora_B." in name)  # zero at the start


@pytest.mark.parametrize("policy", ["full", "selective", "mlp", {"mode": "full", "every_n_layers": 2}])
def test_every_policy_s_adapter_gradients_equal_the_uncheckpointed_step(policy: Any, base: Path,
                                                                        tmp_path: Path) -> None:
    dropout = {"peft": {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1}}  # the adapters' dropout replays the same mask
    loss, grads = recipe_step_gradients(validate_recipe(_recipe(base, tmp_path, "none", **dropout)))
    checkpointed_loss, checkpointed = recipe_step_gradients(validate_recipe(_recipe(base, tmp_path, policy, **dropout)))
    assert checkpointed_loss == loss and grads.keys() == checkpointed.keys() and len(grads) > 10
    assert all(".lora_" in name for name in grads)
    assert all(torch.equal(grads[name], checkpointed[name]) for name in grads)


def test_a_crashed_run_resumes_the_same_curve_and_the_export_is_the_trained_model_in_floats(
        base: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from remat.recipes.finetune import FinetuneRecipe

    straight_job = FinetuneRecipe(validate_recipe(_recipe(base, tmp_path / "straight")))
    straight = straight_job.run()
    crashed = validate_recipe(_recipe(base, tmp_path / "crashed"))

    def crash(job: Any, record: Any) -> None:
        if record.step == 3:
            raise KeyboardInterrupt  # after the step-2 checkpoint, as a killed run

    with pytest.raises(KeyboardInterrupt):
        FinetuneRecipe(crashed, callbacks=[crash]).run()
    resumed = FinetuneRecipe(crashed).run()
    assert [r.step for r in resumed.records] == [3, 4]
    assert [r.loss for r in resumed.records] == [r.loss for r in straight.records][2:]

    export = tmp_path / "straight" / "checkpoints" / "step_4" / "model"
    assert "quantization_config" not in json.loads((export / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(export)
    assert type(merged.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    ids = torch.randint(0, 512, (2, 16))
    trained = straight_job.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, trained(input_ids=ids).logits,
                                   atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("change", "message"), [
    ({"peft": None},
     "model.quantization: the 4-bit base weights are frozen, so nothing would train; add a peft section"),
    ({"distributed": {"activation_checkpointing": "auto", "memory_budget": "1GiB"}},
     "distributed.activation_checkpointing: auto with model.quantization; the planner and the estimate do not model "
     "4-bit weights yet"),
    ({"fp8": {"enabled": True, "emulate": True}}, "fp8.enabled with model.quantization;"),
    ({"model": {"quantization": {"load_in_8bit": True}}}, "model.quantization.load_in_8bit: true; remat trains 4-bit"),
    ({"model": {"quantization": {"load_in_4bit": False}}}, "model.quantization.load_in_4bit: false leaves nothing"),
    ({"model": {"quantization": {}, "dequantize": True}}, "model.quantization with model.dequantize: true;"),
    ({"model": {"quantization": {"bnb_4bit_quant_storage": "uint8"}}, "distributed": {"strategy": "fsdp2"}},
     "model.quantization.bnb_4bit_quant_storage: 'uint8' under distributed.strategy fsdp2"),
    ({"model": {"preset": "tiny-llama", "quantization": {}}},
     "model.quantization: quantises pretrained weights as they load; model.preset and model.config build random"),
])
def test_the_rules_between_keys_are_one_line_each(change: dict[str, Any], message: str, base: Path,
                                                  tmp_path: Path) -> None:
    recipe = _recipe(base, tmp_path)
    for section, value in change.items():
        if section == "model" and "preset" in value:
            recipe["model"] = value
        elif isinstance(value, dict) and isinstance(recipe.get(section), dict):
            recipe[section] = {**recipe[section], **value}
        else:
            recipe[section] = value
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe)
    assert message in str(info.value), str(info.value)


def test_the_estimate_says_it_does_not_model_4_bit_weights(base: Path, tmp_path: Path) -> None:
    from remat.estimate.api import settings_from_recipe

    with pytest.raises(ConfigError, match=r"^model.quantization: the estimate does not model 4-bit \(bitsandbytes\) "
                                          "weights yet"):
        settings_from_recipe(validate_recipe(_recipe(base, tmp_path)), target="cpu")


def test_nemo_s_quantization_section_is_model_quantization() -> None:
    from remat.recipes.nemo import from_nemo

    section = {"load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_compute_dtype": "bfloat16",
               "bnb_4bit_use_double_quant": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_quant_storage": "bfloat16"}
    out, said = from_nemo({"rng": {"seed": 1}, "model": {"pretrained_model_name_or_path": "/m"},
                           "quantization": section})
    assert out["model"]["quantization"] == section and "quantization" not in out
    assert any(line.startswith("quantization -> model.quantization (the base weights quantised to 4 bits")
               for line in said)


def _qlora_trainer(base: Path, out: Path) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=quantization, device_map={"": "cpu"})
    torch.manual_seed(0)  # the adapters' initial weights
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 512, (8, 32), generator=generator)]
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=2, learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, seed=0,
                             save_strategy="no", disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=rows)


def test_a_qlora_trainer_keeps_its_own_losses_with_a_fixed_policy_and_auto_is_refused(base: Path,
                                                                                      tmp_path: Path) -> None:
    import remat

    plain = _qlora_trainer(base, tmp_path / "plain")
    plain.train()
    trainer = _qlora_trainer(base, tmp_path / "remat")
    remat.prepare_trainer(trainer, "full")
    trainer.train()
    losses = [[(row["loss"], row["grad_norm"]) for row in t.state.log_history if "loss" in row]
              for t in (plain, trainer)]
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    with pytest.raises(ConfigError, match=r"^prepare_trainer: policy='auto' does not model 4-bit \(bitsandbytes\) "
                                          "weights yet; allowed: a fixed policy"):
        remat.prepare_trainer(_qlora_trainer(base, tmp_path / "auto"), "auto", memory_budget="1GiB")


def test_the_parameter_count_is_the_weights_a_4_bit_layer_packs(base: Path) -> None:
    from remat.models import ModelConfig, build_model, count_parameters

    plain = build_model(ModelConfig(pretrained_model_name_or_path=str(base)))
    quantised = build_model(ModelConfig(pretrained_model_name_or_path=str(base), quantization={"load_in_4bit": True}))
    assert count_parameters(quantised) == count_parameters(plain) > 0
