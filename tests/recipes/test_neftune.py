"""NEFTune (``training.neftune_noise_alpha``, transformers' own hook): noise of magnitude alpha / sqrt(L x d) on the
input embeddings in training only, kept under LoRA, the same gradients under checkpointing as without (the noise is
drawn once, outside the blocks), refused with context parallelism, and a NeMo ``neftune`` section mapped to it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import tiny_recipe

from remat.errors import ConfigError
from remat.recipes.build import build_recipe_model
from remat.recipes.loader import validate_recipe

ALPHA = 5.0


def _recipe(tmp_path: Path, **sections: Any) -> Any:
    return validate_recipe(tiny_recipe(**{"output_dir": str(tmp_path / "run"), "dataset": {"seq_length": 64},
                                          "training": {"neftune_noise_alpha": ALPHA}, **sections}))


@pytest.mark.parametrize("peft", [None, {"r": 4}])
def test_noise_of_alpha_over_sqrt_length_times_width_in_training_only(tmp_path: Path, peft: Any) -> None:
    model = build_recipe_model(_recipe(tmp_path, peft=peft), vocab_size=None)
    embeddings = model.get_input_embeddings()
    ids = torch.randint(0, 100, (2, 64))
    clean = torch.nn.functional.embedding(ids, embeddings.weight)
    model.train()
    noisy = embeddings(ids)
    bound = ALPHA / math.sqrt(64 * embeddings.weight.shape[1])
    assert 0 < (noisy - clean).abs().max() <= bound * (1 + 1e-6)
    model.eval()
    assert torch.equal(embeddings(ids), clean)


def test_checkpointing_under_neftune_keeps_the_gradients(tmp_path: Path) -> None:
    from remat.distributed import DistributedSetup
    from remat.estimate import StepSettings
    from remat.estimate.simulate import make_batch
    from remat.recipes.build import build_training_module

    def gradients(policy: str) -> dict[str, torch.Tensor]:
        recipe = _recipe(tmp_path, distributed={"activation_checkpointing": policy})
        torch.manual_seed(0)
        model = build_recipe_model(recipe, vocab_size=None)
        root = build_training_module(model, recipe, DistributedSetup.from_config(recipe.distributed, device="cpu"))
        batch = make_batch(recipe, StepSettings(target="cpu").run(), model.config.vocab_size)
        root(batch, num_label_tokens=int((batch["labels"] != -100).sum())).backward()
        return {name: p.grad for name, p in model.named_parameters()}

    plain, checkpointed = gradients("none"), gradients("full")
    assert all(torch.equal(plain[name], checkpointed[name]) for name in plain)


def test_context_parallel_is_refused_and_a_nemo_section_maps(tmp_path: Path) -> None:
    from remat.recipes.nemo import from_nemo

    with pytest.raises(ConfigError, match=r"training.neftune_noise_alpha with distributed.cp_size 2: NEFTune scales "
                                          r"its noise by the row's length"):
        _recipe(tmp_path, distributed={"strategy": "fsdp2", "cp_size": 2})
    data = {"model": {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
                      "config": {"model_type": "llama"}}, "neftune": {"noise_alpha": ALPHA}}
    out, said = from_nemo(data)
    assert out["training"] == {"neftune_noise_alpha": ALPHA}
    assert ("neftune.noise_alpha 5.0 -> training.neftune_noise_alpha (transformers' NEFTune hook on the input "
            "embeddings)") in said
    with pytest.raises(ConfigError, match=r"neftune: \{'noise_alpha': 5.0, 'mode': 'x'\}; allowed: \{noise_alpha: A\}"):
        from_nemo({**data, "neftune": {"noise_alpha": ALPHA, "mode": "x"}})
