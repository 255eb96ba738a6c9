"""FP8 training through torchao (`remat.models.fp8`, the recipe's ``fp8`` section), on the CPU with ``emulate: true``
(the same casts with ordinary matrix multiplies): which layers convert, the rules between keys and the device, every
checkpointing policy's gradients against the un-checkpointed FP8 step, the estimate against the logged ``mem``, and
a NeMo AutoModel ``fp8`` section read as it is."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import recipe_step_gradients, tiny_recipe

from remat.errors import ConfigError
from remat.models.fp8 import FP8Config, apply_fp8, check_fp8_device
from remat.recipes.loader import validate_recipe

FP8 = {"enabled": True, "emulate": True, "filter_fqns": ["lm_head"]}


def _recipe(tmp_path: Path, policy: Any = "none", **sections: Any) -> Any:
    return validate_recipe(tiny_recipe(**{
        "output_dir": str(tmp_path / "run"), "model": {"dtype": "bfloat16"}, "dataset": {"seq_length": 64},
        "step_scheduler": {"max_steps": 2}, "checkpoint": {"enabled": False},
        "logging": {"memory": "tracked", "metrics_file": None},
        "distributed": {"activation_checkpointing": policy}, "fp8": FP8, **sections}))


def test_the_linear_layers_with_dimensions_of_multiples_of_16_convert_but_the_filtered(tmp_path: Path) -> None:
    from remat.recipes.build import build_recipe_model

    model = build_recipe_model(_recipe(tmp_path), vocab_size=None)
    converted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert type(model.lm_head).__name__ == "Linear"  # filter_fqns
    with pytest.raises(ConfigError, match=r"^fp8.enabled: no linear layer of Sequential can run in FP8 .*; allowed: "
                                          r"fp8.enabled: false$"):
        apply_fp8(torch.nn.Sequential(torch.nn.Linear(24, 40)), FP8Config(**FP8), "cpu")


@pytest.mark.parametrize(("keys", "message"), [
    ({"recipe_name": "rowwise", "enable_fsdp_float8_all_gather": True},
     "fp8.enable_fsdp_float8_all_gather: true needs fp8.recipe_name tensorwise (got 'rowwise': its scales are per "
     "row); allowed with it: false"),
    ({"precompute_float8_dynamic_scale_for_fsdp": True},
     "fp8.precompute_float8_dynamic_scale_for_fsdp: true computes the scales of the weights FSDP2 gathers in FP8; "
     "set fp8.enable_fsdp_float8_all_gather: true too, or set it false"),
    ({"recipe_name": "blockwise"}, "fp8.recipe_name: got 'blockwise'; allowed: 'tensorwise', 'rowwise' or "
                                   "'rowwise_with_gw_hp'"),
])
def test_the_rules_between_keys_are_one_line_each(keys: dict[str, Any], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        _recipe(tmp_path, fp8={**FP8, **keys})
    assert message in str(info.value) and str(info.value).count("\n") <= 1


def test_a_device_without_fp8_matrix_multiplies_is_refused_before_the_data(tmp_path: Path) -> None:
    from remat.recipes.finetune import FinetuneRecipe

    with pytest.raises(ConfigError, match=r"^fp8.emulate: false needs FP8 matrix multiplies, which the cpu has not "
                                          r"\(a CUDA GPU of compute capability 8.9 or later\); allowed here: "
                                          r"fp8.emulate: true"):
        FinetuneRecipe(_recipe(tmp_path, fp8={**FP8, "emulate": False}))
    check_fp8_device(FP8Config(enabled=False), torch.device("cpu"))  # nothing to check when off
    with pytest.raises(ConfigError, match="dataset.seq_length: 40 with fp8.enabled; FP8 matrix multiplies take "
                                          r"dimensions that are multiples of 16; allowed: a multiple of 16 \(e.g. 48\)"):
        _recipe(tmp_path, fp8={**FP8, "emulate": False}, dataset={"seq_length": 40})
    with pytest.raises(ConfigError, match="fp8.enable_fsdp_float8_all_gather: true is how FSDP2 gathers sharded "
                                          "weights, but distributed.strategy is 'single'; allowed with it: false"):
        _recipe(tmp_path, fp8={**FP8, "enable_fsdp_float8_all_gather": True})


@pytest.mark.parametrize("policy", ["full", "selective", "mlp", {"mode": "full", "every_n_layers": 2}])
def test_every_policy_s_fp8_gradients_equal_the_unchekpointed_fp8_step(policy: Any, tmp_path: Path) -> None:
    loss, grads = recipe_step_gradients(_recipe(tmp_path, "none"))
    checkpointed_loss, checkpointed = recipe_step_gradients(_recipe(tmp_path, policy))
    assert checkpointed_loss == loss and grads.keys() == checkpointed.keys() and len(grads) > 10
    assert all(torch.equal(grads[name], checkpointed[name]) for name in grads)
    plain_loss, _ = recipe_step_gradients(_recipe(tmp_path, "none", fp8={"enabled": False}))
    assert plain_loss != loss  # the FP8 casts are in the step


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_the_estimate_of_an_fp8_recipe_equals_its_logged_mem(policy: str, tmp_path: Path) -> None:
    """As tests/estimate/test_estimate_vs_real.py checks the other recipes (without checkpointing the corpus's rows
    and the estimate's synthetic ones differ by 32 KiB, with FP8 or without: not compared here)."""
    from remat import estimate_memory
    from remat.estimate.api import settings_from_recipe
    from remat.recipes.finetune import FinetuneRecipe

    cfg = _recipe(tmp_path, policy)
    model, settings = settings_from_recipe(cfg, target="cpu", documents_per_row=2)
    estimate = estimate_memory(model, settings)
    measured = FinetuneRecipe(cfg).run().records[-1].mem_bytes
    assert estimate.peak_bytes == measured, (estimate.peak_bytes, measured)
    plain = estimate_memory(model, settings_from_recipe(_recipe(tmp_path, policy, fp8={"enabled": False}),
                                                        target="cpu", documents_per_row=2)[1])
    if policy == "selective":  # it keeps what the FP8 layers save for backward (full keeps block inputs only)
        assert plain.peak_bytes != estimate.peak_bytes


def test_a_nemo_fp8_section_is_read_as_it_is(tmp_path: Path) -> None:
    from remat.recipes.nemo import from_nemo

    section = {"enabled": True, "recipe_name": None, "enable_fsdp_float8_all_gather": True,
               "precompute_float8_dynamic_scale_for_fsdp": True, "force_recompute_fp8_weight_in_bwd": True,
               "filter_fqns": ["lm_head"], "emulate": False}
    data = {"model": {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
                      "config": {"model_type": "llama"}}, "fp8": dict(section)}
    out, said = from_nemo(data)
    assert FP8Config.model_validate(out["fp8"]) == FP8Config(**{**section, "recipe_name": "tensorwise"})
    assert "fp8: read as it is (torchao's FP8 training of the linear layers, the same keys)" in said


@pytest.mark.gpus(1)
@pytest.mark.parametrize("policy", ["none", "selective"])
def test_fp8_on_a_gpu_trains_and_is_estimated(policy: str, tmp_path: Path) -> None:
    """FP8 matrix multiplies (not emulated) on a GPU of compute capability 8.9 or later: 2 steps of finite losses,
    and the estimate (``target="cuda"``) against the step's ``torch.cuda.max_memory_allocated`` within the estimate's
    stated 3% (tests/estimate/test_estimate_vs_real.py's tolerance, cuBLAS workspaces included there)."""
    from remat import estimate_memory
    from remat.estimate.api import settings_from_recipe
    from remat.models.fp8 import FP8_CAPABILITY
    from remat.recipes.finetune import FinetuneRecipe

    if torch.cuda.get_device_capability() < FP8_CAPABILITY:
        pytest.skip(f"FP8 needs compute capability {FP8_CAPABILITY}; this GPU has {torch.cuda.get_device_capability()}")
    cfg = _recipe(tmp_path, policy, fp8={**FP8, "emulate": False}, model={"dtype": "bfloat16", "config": {
        "hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8, "num_key_value_heads": 4}},
        distributed={"device": "cuda", "activation_checkpointing": policy},
        logging={"memory": "cuda", "metrics_file": None})
    records = FinetuneRecipe(cfg).run().records
    assert all(math.isfinite(r.loss) for r in records) and len(records) == 2
    model, settings = settings_from_recipe(cfg, target="cuda", documents_per_row=2)
    estimate = estimate_memory(model, settings).peak_bytes
    assert abs(estimate - records[-1].mem_bytes) <= 0.03 * records[-1].mem_bytes, (estimate, records[-1].mem_bytes)
