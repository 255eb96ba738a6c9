"""ModelConfig validation: one source, a local directory or a Hub id, known presets; messages name model.<key>."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from remat.errors import ConfigError
from remat.hub import is_hub_id
from remat.models import ModelConfig, build_model


def _error_of(**fields: object) -> str:
    with pytest.raises(ValidationError) as info:
        ModelConfig(**fields)
    return str(info.value)


def test_preset_is_normalised_to_its_canonical_name() -> None:
    cfg = ModelConfig(preset="  Llama-3.2-1B ")
    assert cfg.preset == "llama-3.2-1b"
    assert cfg.source == "preset"
    assert cfg.describe() == "random weights, preset llama-3.2-1b (public config of meta-llama/Llama-3.2-1B)"


def test_defaults() -> None:
    cfg = ModelConfig(config={"model_type": "llama"})
    assert (cfg.dtype, cfg.autocast, cfg.attn_implementation) == ("float32", None, None)
    assert cfg.output_hidden_states is False and cfg.trust_remote_code is False
    assert cfg.source == "config"


def test_no_source_lists_the_three_choices() -> None:
    message = _error_of()
    assert "model: no model source given" in message
    for key in ("model.pretrained_model_name_or_path", "model.preset", "model.config", "tiny-llama"):
        assert key in message


@pytest.mark.parametrize("hub_id", ["meta-llama/Llama-3.2-1B", "gpt2", "org/name_1.0"])
def test_hub_id_is_accepted_without_looking_it_up(hub_id: str) -> None:
    cfg = ModelConfig(pretrained_model_name_or_path=hub_id)  # no network, no cache: resolved when the model is built
    assert cfg.pretrained_model_name_or_path == hub_id and cfg.source == "pretrained"
    assert is_hub_id(hub_id)


@pytest.mark.parametrize("value", ["./missing/dir", "a/b/c", "org/na..me", "-org/name", "org--x/name", "~/nowhere"])
def test_neither_a_directory_nor_a_hub_id_is_refused(value: str) -> None:
    message = _error_of(pretrained_model_name_or_path=value)
    assert f"model.pretrained_model_name_or_path: {value!r} is neither a local directory nor a Hub id" in message
    assert not is_hub_id(value)


def test_an_existing_directory_wins_over_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cfg = ModelConfig(pretrained_model_name_or_path="org/name")
    with pytest.raises(ConfigError, match=r"'org/name' has no config.json; give a directory"):
        build_model(cfg)  # read as the local directory, not looked up on the Hub


def test_a_file_is_not_a_model_directory(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    assert "is a file; give the directory" in _error_of(pretrained_model_name_or_path=str(file))


def test_local_directory_is_accepted(tmp_path: Path) -> None:
    cfg = ModelConfig(pretrained_model_name_or_path=str(tmp_path))
    assert cfg.source == "pretrained"
    assert cfg.describe() == f"pretrained weights from {tmp_path}"


@pytest.mark.parametrize("other", [{"preset": "tiny-llama"}, {"config": {"model_type": "llama"}}])
def test_pretrained_excludes_other_sources(tmp_path: Path, other: dict[str, object]) -> None:
    message = _error_of(pretrained_model_name_or_path=str(tmp_path), **other)
    assert f"model.pretrained_model_name_or_path and model.{next(iter(other))} are both given" in message


def test_unknown_preset_suggests_the_closest_name() -> None:
    message = _error_of(preset="llama-3.2-1")
    assert "model.preset: unknown preset 'llama-3.2-1'. Did you mean 'llama-3.2-1b'?" in message
    assert "qwen3-30b-a3b" in message  # the full list follows


def test_config_without_model_type_is_refused() -> None:
    message = _error_of(config={"hidden_size": 64})
    assert "model.config.model_type: must be a transformers model type" in message and "got None" in message


def test_config_may_override_a_preset_without_model_type() -> None:
    cfg = ModelConfig(preset="tiny-llama", config={"num_hidden_layers": 2})
    assert cfg.source == "preset"
    assert "with overrides ['num_hidden_layers']" in cfg.describe()


def test_config_model_type_must_agree_with_the_preset() -> None:
    message = _error_of(preset="tiny-llama", config={"model_type": "qwen3"})
    assert "model.config.model_type: 'qwen3' contradicts model.preset 'tiny-llama', which is 'llama'" in message


@pytest.mark.parametrize(
    ("field", "value"), [("dtype", "float64"), ("autocast", "float32"), ("attn_implementation", "flash")]
)
def test_literal_fields_reject_other_values(field: str, value: str) -> None:
    with pytest.raises(ValidationError) as info:
        ModelConfig(preset="tiny-llama", **{field: value})
    assert info.value.errors()[0]["loc"] == (field,)
    assert info.value.errors()[0]["type"] == "literal_error"


def test_unknown_key_is_forbidden() -> None:
    with pytest.raises(ValidationError) as info:
        ModelConfig(preset="tiny-llama", presets="x")
    assert info.value.errors()[0]["type"] == "extra_forbidden"


def test_validator_errors_carry_the_remat_error() -> None:
    with pytest.raises(ValidationError) as info:
        ModelConfig(preset="nope")
    assert isinstance(info.value.errors()[0]["ctx"]["error"], ConfigError)


def test_keys_the_stock_config_writes_are_accepted_when_the_built_config_agrees() -> None:
    """A saved config.json carries derived fields (deepseek's ``qk_head_dim``, mamba's ``intermediate_size``): they
    are accepted when transformers keeps them, and a typo is still refused."""
    from remat.models.build import resolve_model_config

    deepseek = {"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
                "num_hidden_layers": 2, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "qk_head_dim": 24}
    assert resolve_model_config(ModelConfig(config=deepseek)).qk_head_dim == 24
    mamba = {"model_type": "mamba", "hidden_size": 64, "expand": 2, "intermediate_size": 128, "num_hidden_layers": 2}
    assert resolve_model_config(ModelConfig(config=mamba)).intermediate_size == 128
    with pytest.raises(ConfigError, match=r"model.config.qk_head_dimm: .* has no such field.*'qk_head_dim'"):
        resolve_model_config(ModelConfig(config={**deepseek, "qk_head_dimm": 24}))


def test_non_finite_config_values_survive_the_json_dump() -> None:
    """mamba2's ``time_step_limit`` is ``[0.0, inf]``: a JSON-mode dump (what the estimate's recipe copy is made
    from) keeps the float, where pydantic's default writes null."""
    config = ModelConfig(config={"model_type": "mamba2", "time_step_limit": [0.0, float("inf")]})
    assert config.model_dump(mode="json")["config"]["time_step_limit"] == [0.0, float("inf")]
