"""examples/long_context.yaml: listed by `remat recipes`, and it trains on the CPU with a tiny model override, with
its policy (full, tiled, offloaded inputs), packing off and the final norm tiled."""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.cli import main
from remat.recipes.loader import load_recipe
from remat.recipes.shipped import shipped_recipes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "long_context.yaml"


def test_the_example_is_shipped_and_says_what_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    assert shipped_recipes()["long_context"].summary.startswith("Long-context fine-tuning: one long document per row")
    assert main(["recipes"]) == 0
    assert "long_context" in capsys.readouterr().out
    cfg = load_recipe(EXAMPLE, [])
    policy = cfg.distributed.activation_checkpointing
    assert (policy.mode, policy.tiled, policy.offload) == ("full", True, True)
    assert cfg.dataset.packing is False and cfg.step_scheduler.local_batch_size == 1
    assert cfg.loss_fn.target == "remat.loss.FusedLinearCrossEntropy"


def test_the_example_trains_on_the_cpu_with_a_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "cache"))
    code = main(["finetune", str(EXAMPLE), "--model.preset", "tiny-llama", "--model.dtype", "float32",
                 "--step_scheduler.max_steps", "2", "--step_scheduler.ckpt_every_steps", "2",
                 "--output_dir", str(tmp_path / "out"), "--tokenizer.vocab_size", "512",
                 "--dataset.seq_length", "512", "--distributed.activation_checkpointing.tile_tokens", "64"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "full, inputs offloaded, tiled (64 tokens)" in out
    assert "the final norm (model.norm) runs over chunks of the tokens too" in out
    assert "step 2 | epoch 0 | loss" in out
