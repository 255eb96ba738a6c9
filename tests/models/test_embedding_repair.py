"""``model.embedding_row_repair`` (`remat.models.embedding_repair`): input-embedding rows a checkpoint left at zero
take their output row's direction at the healthy rows' RMS norm; healthy rows untouched; tied embeddings, too many
damaged rows and damaged sources refused in one line; a pretrained checkpoint repaired as the recipe loads it; NeMo's
section mapped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import tiny_causal_lm, tiny_recipe

from remat.errors import ConfigError
from remat.models.embedding_repair import EmbeddingRowRepair, repair_embedding_rows

DAMAGED = [3, 17, 250]


def _damaged(tied: bool = False) -> torch.nn.Module:
    model = tiny_causal_lm(tie_word_embeddings=tied)
    with torch.no_grad():
        model.get_input_embeddings().weight[DAMAGED[:2]] = 0.0
        model.get_input_embeddings().weight[DAMAGED[2]] = float("nan")
    return model


def test_damaged_rows_take_the_output_direction_at_the_healthy_rms_norm() -> None:
    model = _damaged()
    before = model.get_input_embeddings().weight.detach().clone()
    assert repair_embedding_rows(model, EmbeddingRowRepair()) == DAMAGED
    after = model.get_input_embeddings().weight.detach()
    healthy = torch.ones(len(before), dtype=torch.bool)
    healthy[DAMAGED] = False
    assert torch.equal(after[healthy], before[healthy])
    target = before[healthy].norm(dim=1).pow(2).mean().sqrt()
    head = model.get_output_embeddings().weight.detach()[DAMAGED]
    assert torch.allclose(after[DAMAGED], head * (target / head.norm(dim=1)).unsqueeze(1))
    assert repair_embedding_rows(model, EmbeddingRowRepair()) == []  # nothing left to repair


@pytest.mark.parametrize(("model", "cfg", "message"), [
    (lambda: _damaged(tied=True), EmbeddingRowRepair(), "model.embedding_row_repair: 3 damaged input-embedding rows, "
                                                        "but the output embeddings are tied to them"),
    (_damaged, EmbeddingRowRepair(max_rows=2), "model.embedding_row_repair.max_rows: 3 input-embedding rows have a "
                                               "norm of at most 1e-06"),
])
def test_what_cannot_be_repaired_is_one_line(model: object, cfg: EmbeddingRowRepair, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        repair_embedding_rows(model(), cfg)  # type: ignore[operator]
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_a_pretrained_checkpoint_is_repaired_as_the_recipe_loads_it(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from remat.recipes.build import build_recipe_model
    from remat.recipes.loader import validate_recipe

    _damaged().save_pretrained(tmp_path / "checkpoint")
    recipe = tiny_recipe(output_dir=str(tmp_path / "run"), model={"preset": None, "config": None,
                         "pretrained_model_name_or_path": str(tmp_path / "checkpoint"),
                         "embedding_row_repair": {"min_norm": 1e-4}})
    model = build_recipe_model(validate_recipe(recipe), vocab_size=None)
    assert torch.isfinite(model.get_input_embeddings().weight).all()
    assert "model.embedding_row_repair: repaired 3 input-embedding rows from the output embeddings (ids [3, 17, 250])" in (
        caplog.text)


def test_nemo_s_section_maps_to_the_model_key() -> None:
    from remat.recipes.nemo import from_nemo

    data = {"model": {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
                      "config": {"model_type": "llama"}}, "embedding_row_repair": {"min_norm": 1e-4, "max_rows": 8}}
    out, said = from_nemo(data)
    assert out["model"]["embedding_row_repair"] == {"min_norm": 1e-4, "max_rows": 8}
    assert any(line.startswith("embedding_row_repair -> model.embedding_row_repair") for line in said)
