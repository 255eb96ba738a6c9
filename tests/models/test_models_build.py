"""build_model / resolve_model_config: presets, config mappings, local pretrained directories, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from remat.errors import ConfigError
from remat.models import ModelConfig, build_model, count_parameters
from remat.models.build import resolve_model_config

TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64}


def _tiny(**overrides: object) -> ModelConfig:
    return ModelConfig(config={**TINY_LLAMA, **overrides})


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_weights_are_deterministic_under_the_seed() -> None:
    cfg = ModelConfig(preset="tiny-llama", config={"num_hidden_layers": 1})
    torch.manual_seed(3)
    first = _state(build_model(cfg, vocab_size=128))
    torch.manual_seed(3)
    second = _state(build_model(cfg, vocab_size=128))
    torch.manual_seed(4)
    third = _state(build_model(cfg, vocab_size=128))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["model.layers.0.self_attn.q_proj.weight"],
                           third["model.layers.0.self_attn.q_proj.weight"])


def test_dtype_and_training_flags_are_applied() -> None:
    model = build_model(_tiny())
    assert model.config.use_cache is False and model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    bf16 = build_model(ModelConfig(config=TINY_LLAMA, dtype="bfloat16", attn_implementation="eager"))
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.config._attn_implementation == "eager"


def test_dtype_auto_is_the_dtype_the_checkpoint_or_config_names(tmp_path: Path) -> None:
    """``model.dtype: auto`` as transformers' ``dtype="auto"``: a saved checkpoint's config.json dtype, a config
    mapping's own, float32 where none is named (a preset); the estimate of that model is its float32 or bfloat16 one."""
    from remat import estimate_memory

    assert next(build_model(ModelConfig(preset="tiny-llama", dtype="auto")).parameters()).dtype == torch.float32
    named = ModelConfig(config={**TINY_LLAMA, "torch_dtype": "bfloat16"}, dtype="auto")
    assert next(build_model(named).parameters()).dtype == torch.bfloat16
    build_model(_tiny(), vocab_size=64).to(torch.bfloat16).save_pretrained(tmp_path / "saved")
    saved = ModelConfig(pretrained_model_name_or_path=str(tmp_path / "saved"), dtype="auto")
    assert {p.dtype for p in build_model(saved).parameters()} == {torch.bfloat16}
    settings = {"target": "cpu", "batch_size": 1, "seq_length": 16}
    assert estimate_memory(saved, **settings).peak_bytes == estimate_memory(
        saved.model_copy(update={"dtype": "bfloat16"}), **settings).peak_bytes


def test_small_preset_takes_the_tokenizer_vocabulary() -> None:
    model = build_model(ModelConfig(preset="tiny-gemma3n"), vocab_size=300)
    assert model.config.vocab_size == 300 and model.config.vocab_size_per_layer_input == 300
    assert model.get_input_embeddings().num_embeddings == 300
    assert resolve_model_config(ModelConfig(preset="tiny-llama")).vocab_size == 8192


def test_published_preset_keeps_its_vocabulary_when_the_tokenizer_is_smaller() -> None:
    config = resolve_model_config(ModelConfig(preset="qwen3-0.6b"), vocab_size=300)
    assert config.vocab_size == 151936 and config.use_cache is False


def test_config_without_vocab_size_takes_the_tokenizers() -> None:
    mapping = {k: v for k, v in TINY_LLAMA.items() if k != "vocab_size"}
    assert resolve_model_config(ModelConfig(config=mapping), vocab_size=77).vocab_size == 77


def test_vocabulary_smaller_than_the_tokenizer_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"^model\.config\.vocab_size: 64 is smaller than the tokenizer's 100 tokens"):
        resolve_model_config(_tiny(), vocab_size=100)
    with pytest.raises(ConfigError, match=r"^model\.config\.vocab_size: 50 is smaller"):
        build_model(ModelConfig(preset="tiny-llama", config={"vocab_size": 50}), vocab_size=100)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_vocab_size_argument_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^vocab_size: must be a positive integer"):
        resolve_model_config(_tiny(), vocab_size=bad)  # type: ignore[arg-type]


def test_unknown_model_type_suggests_close_ones() -> None:
    with pytest.raises(ConfigError, match=r"^model\.config\.model_type: transformers has no model type 'lama'\. "
                                          r"Close matches: .*llama"):
        resolve_model_config(ModelConfig(config={"model_type": "lama"}))


def test_model_type_without_causal_lm_class_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'vit' has no causal-LM class"):
        resolve_model_config(ModelConfig(config={"model_type": "vit"}))


def test_misspelt_config_key_is_an_error_not_silently_ignored() -> None:
    cfg = ModelConfig(preset="tiny-llama", config={"num_hiden_layers": 2})
    with pytest.raises(ConfigError, match=r"^model\.config\.num_hiden_layers: LlamaConfig \('llama'\) has no such "
                                          r"field, so transformers would ignore it\. Did you mean 'num_hidden_layers'"):
        build_model(cfg)


def test_legacy_keys_transformers_still_reads_are_accepted() -> None:
    config = resolve_model_config(_tiny(rope_theta=1234.0, torch_dtype="float32"))
    assert config.rope_parameters["rope_theta"] == 1234.0


def test_invalid_values_raise_config_error_with_the_transformers_message() -> None:
    with pytest.raises(ConfigError, match=r"^model\.config: transformers rejected the 'llama' config: .*"
                                          r"expected int, got str"):
        resolve_model_config(_tiny(bos_token_id="many"))
    # Shape numbers are checked before transformers sees them (tests/models/test_models_shape.py).
    with pytest.raises(ConfigError, match=r"^model\.config\.num_attention_heads: 4 does not divide hidden_size=30"):
        resolve_model_config(_tiny(hidden_size=30))
    with pytest.raises(ConfigError, match=r"^model\.config\.num_hidden_layers: got 'two'; allowed: an integer >= 1"):
        resolve_model_config(_tiny(num_hidden_layers="two"))


def test_preset_override_changes_only_that_field() -> None:
    base = resolve_model_config(ModelConfig(preset="qwen3-8b"))
    short = resolve_model_config(ModelConfig(preset="qwen3-8b", config={"num_hidden_layers": 2}))
    assert (base.num_hidden_layers, short.num_hidden_layers) == (36, 2)
    assert short.hidden_size == base.hidden_size == 4096


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-moe", "tiny-gemma3n", "llama-20m"])
def test_small_presets_train_on_the_cpu(preset: str) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset=preset, config={"num_hidden_layers": 2} if preset != "tiny-gemma3n"
                                    else None), vocab_size=96)
    ids = torch.randint(0, 96, (2, 24))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert 3.0 < loss.item() < 6.0  # about ln(96) = 4.56 at random init
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_count_parameters_counts_tied_weights_once_and_can_skip_frozen() -> None:
    model = build_model(_tiny(tie_word_embeddings=True))
    embedding = 64 * 32
    layer = 32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64 + 2 * 32
    assert count_parameters(model) == embedding + 2 * layer + 32
    model.get_input_embeddings().weight.requires_grad_(False)
    assert count_parameters(model, trainable_only=True) == 2 * layer + 32


# ------------------------------------------------------------------------------------------------ pretrained


@pytest.fixture
def saved_tiny(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = build_model(_tiny())
    model.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny", model


def test_pretrained_directory_loads_the_same_weights(saved_tiny: tuple[Path, torch.nn.Module]) -> None:
    path, original = saved_tiny
    loaded = build_model(ModelConfig(pretrained_model_name_or_path=str(path)))
    ids = torch.randint(0, 64, (1, 10))
    assert loaded.config.use_cache is False and loaded.training
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, original.eval()(input_ids=ids).logits)


def test_pretrained_dtype_is_applied(saved_tiny: tuple[Path, torch.nn.Module]) -> None:
    path, _ = saved_tiny
    loaded = build_model(ModelConfig(pretrained_model_name_or_path=str(path), dtype="bfloat16"))
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}


def test_pretrained_embeddings_grow_to_the_tokenizer(saved_tiny: tuple[Path, torch.nn.Module]) -> None:
    path, original = saved_tiny
    cfg = ModelConfig(pretrained_model_name_or_path=str(path))
    loaded = build_model(cfg, vocab_size=70)
    weight = loaded.get_input_embeddings().weight
    assert weight.shape == (70, 32) and loaded.config.vocab_size == 70
    assert torch.equal(weight[:64], original.get_input_embeddings().weight)
    meta = build_model(cfg, vocab_size=70, meta=True)
    assert meta.get_input_embeddings().weight.shape == (70, 32) and meta.get_input_embeddings().weight.is_meta
    assert resolve_model_config(cfg, vocab_size=10).vocab_size == 64  # a smaller tokenizer changes nothing


def test_pretrained_directory_without_config_is_a_config_error(tmp_path: Path) -> None:
    cfg = ModelConfig(pretrained_model_name_or_path=str(tmp_path))
    with pytest.raises(ConfigError, match=r"^model\.pretrained_model_name_or_path: '.*' has no config\.json"):
        build_model(cfg)
    with pytest.raises(ConfigError, match=r"has no config\.json"):
        resolve_model_config(cfg)


def test_pretrained_directory_with_a_broken_config_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^model\.pretrained_model_name_or_path: cannot read a transformers config"):
        resolve_model_config(ModelConfig(pretrained_model_name_or_path=str(tmp_path)))


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_a_damaged_weights_file_is_one_line(saved_tiny: tuple[Path, torch.nn.Module], damage: str) -> None:
    path, _ = saved_tiny
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 16 + data[16:])
    with pytest.raises(ConfigError, match=r"^model.pretrained_model_name_or_path: cannot load a causal LM from '.*tiny'"):
        build_model(ModelConfig(pretrained_model_name_or_path=str(path)))
