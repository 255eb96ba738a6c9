"""Presets: the published shapes (checked through parameter counts on the meta device) and the small CPU shapes."""

from __future__ import annotations

import pytest

from remat.errors import ConfigError
from remat.models import ModelConfig, build_model, count_parameters, get_preset, preset_names
from remat.models.presets import PRESETS
from remat.models.presets import DEFAULT_SMALL_VOCAB_SIZE, preset_for_hub_id

# Parameter counts of the released checkpoints (embeddings counted once when tied).
PUBLISHED_PARAMETER_COUNTS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "qwen3-0.6b": 596_049_920,
    "qwen3-8b": 8_190_735_360,
    "gemma-3-1b": 999_885_952,
    "mixtral-8x7b": 46_702_792_704,
    "qwen3-30b-a3b": 30_532_122_624,
}


@pytest.mark.parametrize(("name", "expected"), sorted(PUBLISHED_PARAMETER_COUNTS.items()))
def test_published_presets_have_the_released_parameter_count(name: str, expected: int) -> None:
    model = build_model(ModelConfig(preset=name), meta=True)
    assert next(model.parameters()).device.type == "meta"
    assert count_parameters(model) == expected


def test_gemma_3_1b_alternates_five_sliding_layers_with_one_global() -> None:
    model = build_model(ModelConfig(preset="gemma-3-1b"), meta=True)
    layer_types = model.config.layer_types
    assert [i for i, t in enumerate(layer_types) if t == "full_attention"] == [5, 11, 17, 23]
    assert model.config.sliding_window == 512
    assert model.config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert model.config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0


def test_gemma_3n_e2b_text_tower_shares_kv_in_its_last_ten_layers() -> None:
    model = build_model(ModelConfig(preset="gemma-3n-e2b"), meta=True)
    config = model.config
    assert (config.num_hidden_layers, config.num_kv_shared_layers) == (30, 10)
    assert config.layer_types.count("full_attention") == 6 and config.layer_types[4] == "full_attention"
    assert config.intermediate_size == [8192] * 30
    assert config.activation_sparsity_pattern == [0.95] * 10 + [0.0] * 20
    assert type(model).__name__ == "Gemma3nForCausalLM"


def test_llama_3_2_1b_uses_llama3_rope_scaling() -> None:
    model = build_model(ModelConfig(preset="llama-3.2-1b"), meta=True)
    rope = model.config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("llama3", 32.0, 500_000.0)
    assert model.config.tie_word_embeddings is True and model.config.head_dim == 64


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("tiny-llama", 3_000_000, 8_000_000), ("llama-20m", 18_000_000, 24_000_000)],
)
def test_small_llamas_have_their_advertised_size(name: str, low: int, high: int) -> None:
    count = count_parameters(build_model(ModelConfig(preset=name), meta=True))
    assert low <= count <= high


def test_every_preset_records_its_source_and_model_type() -> None:
    for name, preset in PRESETS.items():
        assert preset.name == name == name.lower()
        assert preset.source and preset.description
        assert preset.model_type == preset.config["model_type"]
        if preset.hub_id is not None:
            assert preset.hub_id in preset.source
            assert preset_for_hub_id(preset.hub_id.upper()) is preset
        else:
            assert preset.tokenizer_vocab_keys  # the small presets take their vocabulary from the tokenizer
            assert all(preset.config[key] == DEFAULT_SMALL_VOCAB_SIZE for key in preset.tokenizer_vocab_keys)


def test_presets_are_read_only() -> None:
    with pytest.raises(TypeError):
        get_preset("tiny-llama").config["hidden_size"] = 1  # type: ignore[index]


def test_required_presets_exist() -> None:
    required = {"llama-3.2-1b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-8b", "gemma-3-1b", "mixtral-8x7b",
                "qwen3-30b-a3b", "gemma-3n-e2b", "tiny-llama", "tiny-moe", "tiny-gemma3n", "llama-20m"}
    assert required <= set(preset_names())


def test_lookup_is_case_insensitive_and_errors_suggest() -> None:
    assert get_preset("QWEN3-8B").name == "qwen3-8b"
    with pytest.raises(ConfigError, match=r"^bench\.model: unknown preset 'tiny-lama'\. Did you mean 'tiny-llama'\?"):
        get_preset("tiny-lama", key="bench.model")
