"""``peft.lora_a_init`` and ``peft.dropout_position`` (NOTE [ NeMo's LoRA on PEFT's adapters ] in
`remat.recipes.build`): NeMo AutoModel's LoRA on PEFT's adapters, A drawn Xavier-normal and the dropout on the
adapter's output. Every checkpointing policy's gradients equal the un-checkpointed step's with the output dropout;
the estimate equals the logged ``mem``; a NeMo recipe gets NeMo's init and dropout unless it says otherwise."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import recipe_step_gradients, tiny_recipe

from remat.recipes.loader import validate_recipe

POST = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.2, "dropout_position": "post"}


def _recipe(tmp_path: Path, peft: dict[str, Any], policy: Any = "none", **sections: Any) -> Any:
    return validate_recipe(tiny_recipe(**{
        "output_dir": str(tmp_path / "run"), "step_scheduler": {"max_steps": 2}, "checkpoint": {"enabled": False},
        "logging": {"memory": "tracked", "metrics_file": None}, "distributed": {"activation_checkpointing": policy},
        "peft": peft, **sections}))


def test_xavier_normal_draws_every_a_at_its_scale_and_b_stays_zero(tmp_path: Path) -> None:
    from remat.recipes.build import build_recipe_model

    torch.manual_seed(0)
    model = build_recipe_model(_recipe(tmp_path, {"r": 8, "lora_a_init": "xavier_normal"}), vocab_size=None)
    a = [m.weight for name, m in model.named_modules() if name.endswith("lora_A.default")]
    b = [m.weight for name, m in model.named_modules() if name.endswith("lora_B.default")]
    assert a and all(torch.count_nonzero(weight) == 0 for weight in b)
    fan_out, fan_in = a[0].shape
    together = torch.cat([weight.flatten() for weight in a if weight.shape == a[0].shape])
    assert together.std().item() == pytest.approx(math.sqrt(2 / (fan_in + fan_out)), rel=0.1)
    torch.manual_seed(0)
    kaiming = build_recipe_model(_recipe(tmp_path, {"r": 8}), vocab_size=None)
    bound = 1 / math.sqrt(fan_in)  # PEFT's Kaiming-uniform with a = sqrt(5)
    first = next(m.weight for name, m in kaiming.named_modules() if name.endswith("lora_A.default"))
    assert first.abs().max().item() <= bound and first.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.2)


@pytest.mark.parametrize("policy", ["full", "selective", {"mode": "full", "every_n_layers": 2}])
def test_every_policy_s_gradients_equal_the_uncheckpointed_step_with_output_dropout(policy: Any,
                                                                                     tmp_path: Path) -> None:
    loss, grads = recipe_step_gradients(_recipe(tmp_path, POST))
    checkpointed_loss, checkpointed = recipe_step_gradients(_recipe(tmp_path, POST, policy))
    assert checkpointed_loss == loss and grads.keys() == checkpointed.keys() and len(grads) > 10
    assert all(torch.equal(grads[name], checkpointed[name]) for name in grads)
    _, pre = recipe_step_gradients(_recipe(tmp_path, {**POST, "dropout_position": "pre"}))
    # B starts at zero, so the loss is the same; B's gradients see the mask on the other side
    assert any(not torch.equal(pre[name], grads[name]) for name in grads if "lora_B" in name)


def test_output_dropout_is_off_in_evaluation(tmp_path: Path) -> None:
    from remat.recipes.build import build_recipe_model

    outputs = []
    for position in ("pre", "post"):
        torch.manual_seed(0)
        model = build_recipe_model(_recipe(tmp_path, {**POST, "dropout_position": position}), vocab_size=None).eval()
        with torch.no_grad():  # B is zero at the start: give the adapters something to say
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.fill_(0.01)
            outputs.append(model(input_ids=torch.arange(16).unsqueeze(0)).logits)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("policy", ["none", "full"])
def test_the_estimate_with_output_dropout_equals_the_logged_mem(policy: str, tmp_path: Path) -> None:
    from remat import estimate_memory
    from remat.estimate.api import settings_from_recipe
    from remat.recipes.finetune import FinetuneRecipe

    cfg = _recipe(tmp_path, POST, policy)
    # the corpus's 32-token rows hold one document each (the estimate's synthetic rows are told so)
    model, settings = settings_from_recipe(cfg, target="cpu", documents_per_row=1)
    estimate = estimate_memory(model, settings)
    measured = FinetuneRecipe(cfg).run().records[-1].mem_bytes
    assert estimate.peak_bytes == measured, (estimate.peak_bytes, measured)


@pytest.mark.parametrize(("nemo", "expected"), [
    ({}, ("xavier_normal", "post")),
    ({"lora_A_init": "uniform", "dropout_position": "pre"}, ("kaiming_uniform", "pre")),
])
def test_a_nemo_recipe_gets_nemo_s_init_and_dropout(nemo: dict[str, Any], expected: tuple[str, str]) -> None:
    from remat.recipes.nemo import from_nemo

    out, said = from_nemo({"rng": {"seed": 1}, "peft": {
        "_target_": "nemo_automodel.components._peft.lora.PeftConfig", "dim": 8, "alpha": 16, "dropout": 0.1,
        **nemo}})
    assert (out["peft"]["lora_a_init"], out["peft"]["dropout_position"]) == expected
    assert any(f"started and dropped out as NeMo's LoRA (lora_a_init {expected[0]}, dropout_position {expected[1]})"
               in line for line in said)
