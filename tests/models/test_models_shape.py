"""Shape numbers of a model config: one ConfigError naming the key, before transformers divides by them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from remat.cli import main
from remat.errors import ConfigError
from remat.models import ModelConfig, build_model
from remat.models.build import resolve_model_config


@pytest.mark.parametrize(("overrides", "message"), [
    ({"hidden_size": 0}, "model.config.hidden_size: got 0; allowed: an integer >= 1"),
    ({"hidden_size": -64}, "model.config.hidden_size: got -64; allowed: an integer >= 1"),
    ({"num_key_value_heads": 0}, "model.config.num_key_value_heads: got 0; allowed: an integer >= 1"),
    ({"num_key_value_heads": 3}, "model.config.num_key_value_heads: 3 does not divide num_attention_heads=4"),
    ({"num_attention_heads": 3}, "model.config.num_attention_heads: 3 does not divide hidden_size=256"),
    ({"vocab_size": 0}, "model.config.vocab_size: got 0; allowed: an integer >= 1"),
    ({"num_hidden_layers": 0}, "model.config.num_hidden_layers: got 0; allowed: an integer >= 1"),
    ({"intermediate_size": 2.5}, "model.config.intermediate_size: got 2.5; allowed: an integer >= 1"),
    ({"num_hidden_layers": True}, "model.config.num_hidden_layers: got True"),
])
def test_bad_shape_numbers_name_the_key(overrides: dict[str, Any], message: str) -> None:
    cfg = ModelConfig(preset="tiny-llama", config=overrides)
    with pytest.raises(ConfigError) as caught:
        resolve_model_config(cfg)
    assert str(caught.value) == message or str(caught.value).startswith(message)
    with pytest.raises(ConfigError, match=message.split(":")[0]):  # the training build takes the same path
        build_model(cfg, meta=True)


def test_the_key_is_named_as_the_architecture_spells_it() -> None:
    with pytest.raises(ConfigError, match=r"^model.config.n_embd: got 0; allowed: an integer >= 1$"):
        resolve_model_config(ModelConfig(config={"model_type": "gpt2", "n_embd": 0}))


def test_heads_may_leave_a_remainder_when_head_dim_is_given() -> None:
    config = resolve_model_config(ModelConfig(preset="tiny-llama", config={
        "hidden_size": 96, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 32}))
    assert (config.hidden_size, config.num_attention_heads, config.head_dim) == (96, 3, 32)
    assert resolve_model_config(ModelConfig(preset="tiny-llama", config={"num_key_value_heads": None}))


def test_finetune_refuses_a_bad_shape_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "cache"))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model": {"preset": "tiny-llama", "config": {"hidden_size": -64}}, "output_dir": str(tmp_path / "out"),
        "dataset": {"seq_length": 32}, "step_scheduler": {"max_steps": 1, "global_batch_size": 2,
                                                          "local_batch_size": 2}}))
    assert main(["finetune", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: model.config.hidden_size: got -64; allowed: an integer >= 1"]
    assert "Traceback" not in err and not (tmp_path / "out" / "latest").exists()
