"""``model.dequantize`` (NOTE [ Quantised checkpoints ] in `remat.models.build`): a checkpoint published quantised
(FP8 blocks with their ``weight_scale_inv``, as DeepSeek's are) loads dequantised to ``model.dtype`` by transformers'
own quantizer and trains as plain ``nn.Linear`` layers; without the key it is refused before any weight is read; a
method transformers cannot dequantise is refused by name; a float checkpoint loads as it is, said once. NeMo's
``checkpoint.dequantize_base_checkpoint`` is the same key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny import tiny_causal_lm, tiny_recipe

from remat.errors import ConfigError
from remat.models import ModelConfig, build_model

BLOCK = 16


def _fp8_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """A tiny Llama saved as an FP8 checkpoint is (every projection in float8_e4m3fn with a float32 scale per
    16 x 16 block, ``quantization_config`` in config.json); returns the bfloat16 weights it was made from."""
    model = tiny_causal_lm().to(torch.bfloat16)
    reference = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in reference.items():
        if not name.endswith("proj.weight"):
            tensors[name] = weight.contiguous()
            continue
        rows, cols = weight.shape
        blocks = weight.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
        tensors[name] = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
        tensors[name.replace("weight", "weight_scale_inv")] = scale
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {**model.config.to_dict(), "dtype": "bfloat16", "architectures": ["LlamaForCausalLM"],
              "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [BLOCK, BLOCK]}}
    (directory / "config.json").write_text(json.dumps(config))
    return reference


def test_an_fp8_checkpoint_loads_dequantised_and_trains_as_plain_linears(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    reference = _fp8_checkpoint(tmp_path / "fp8")
    caplog.set_level("INFO", logger="remat.models.build")
    model = build_model(ModelConfig(pretrained_model_name_or_path=str(tmp_path / "fp8"), dtype="bfloat16",
                                    dequantize=True))
    assert any("is quantised (fp8); its weights are dequantised to bfloat16" in r.getMessage() for r in caplog.records)
    projection = model.model.layers[0].self_attn.q_proj
    assert type(projection) is torch.nn.Linear and projection.weight.dtype == torch.bfloat16
    assert not any("scale" in name for name in model.state_dict())
    for name, weight in model.state_dict().items():  # FP8's 3 mantissa bits: within 1/16 of each block's largest
        assert (weight.float() - reference[name].float()).abs().max() <= reference[name].abs().max() / 16, name
    assert getattr(model.config, "quantization_config", None) is None  # what it saves is a float checkpoint
    loss = model(input_ids=torch.randint(0, 256, (1, 8)), labels=torch.randint(0, 256, (1, 8))).loss
    loss.backward()
    assert projection.weight.grad is not None and torch.isfinite(projection.weight.grad).all()


def test_a_quantised_checkpoint_without_the_key_is_refused_before_its_weights_load(tmp_path: Path) -> None:
    _fp8_checkpoint(tmp_path / "fp8")
    with pytest.raises(ConfigError, match=r"is a quantised checkpoint \(fp8\); remat trains floating-point weights: "
                                          r"set model.dequantize: true"):
        build_model(ModelConfig(pretrained_model_name_or_path=str(tmp_path / "fp8"), dtype="bfloat16"))


def test_a_method_transformers_cannot_dequantise_is_refused_by_name(tmp_path: Path) -> None:
    _fp8_checkpoint(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model.dequantize: .* is quantised with bitsandbytes, which transformers "
                                          "cannot dequantise as it loads; allowed: fp8, mxfp4"):
        build_model(ModelConfig(pretrained_model_name_or_path=str(tmp_path / "q"), dequantize=True))


def test_a_float_checkpoint_with_the_key_loads_as_it_is_said_once(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    tiny_causal_lm().save_pretrained(tmp_path / "float")
    caplog.set_level("INFO", logger="remat.models.build")
    model = build_model(ModelConfig(pretrained_model_name_or_path=str(tmp_path / "float"), dequantize=True))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model.dequantize:")]
    assert said == [f"model.dequantize: {tmp_path / 'float'} is not quantised; its weights load as they are"]
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, tiny_causal_lm().model.layers[0].mlp.up_proj.weight)


def test_nemo_s_dequantize_base_checkpoint_is_the_same_key() -> None:
    from remat.recipes.nemo import from_nemo

    recipe = {**tiny_recipe(), "checkpoint": {"dequantize_base_checkpoint": True}, "rng": {"seed": 1}}
    out, said = from_nemo(recipe)
    assert out["model"]["dequantize"] is True and "dequantize_base_checkpoint" not in out["checkpoint"]
    assert any(line.startswith("checkpoint.dequantize_base_checkpoint true -> model.dequantize true") for line in said)
