"""`torch.compile` of each block after wrapping: compiles, recomputes, and gives the eager gradients."""

from __future__ import annotations

import pytest
import torch
from ckpt_models import batch, step_grads, tiny_model

from remat.checkpointing import apply_activation_checkpointing


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "num_layers"), [("aot_eager", 2), ("inductor", 1)])
def test_compiled_blocks_after_full_checkpointing(
    backend: str, num_layers: int, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # aot_eager traces the wrapped forward and partitions the checkpoint like inductor does, in a few seconds;
    # inductor also generates code (about 6 s per block on this CPU), so it gets one block.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    model = tiny_model("llama", num_layers=num_layers)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.0  # compiled dropout draws other random numbers than eager
    ids = batch()
    expected = step_grads(model, ids)

    apply_activation_checkpointing(model, "full")
    for layer in model.model.layers:
        layer.compile(backend=backend)
    frames_before = torch._dynamo.utils.counters["frames"]["ok"]
    actual = step_grads(model, ids)
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames_before  # the blocks really were compiled
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


def test_a_recipe_s_compile_section_compiles_each_block_and_trains_the_eager_losses(tmp_path) -> None:
    """``compile: {enabled: true}`` in a recipe: every decoder block compiled after checkpointing wraps it (dynamo
    counts the frames), the per-step losses the eager run's (no dropout here); on the CPU the step's memory is read
    as RSS, since the exact tracker's dispatch mode would make the compiled blocks run eagerly (``tracked`` is
    refused at load)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    from test_finetune import run, tiny_recipe

    from remat.errors import ConfigError
    from remat.recipes.loader import validate_recipe

    torch._dynamo.reset()
    common = {"distributed": {"activation_checkpointing": "full"}, "step_scheduler": {"max_steps": 2},
              "checkpoint": {"enabled": False}}
    _, eager = run(tiny_recipe(tmp_path / "eager", **common))
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    job, compiled = run(tiny_recipe(tmp_path / "compiled", compile={"enabled": True, "backend": "aot_eager"},
                                    **common))
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in job.model.model.layers)
    torch.testing.assert_close([r.loss for r in compiled.records], [r.loss for r in eager.records], rtol=1e-5,
                               atol=0)
    assert job.memory_meter.last.source.startswith("rss")
    with pytest.raises(ConfigError, match=r"^compile.enabled: true with logging.memory: tracked; .*allowed: "
                                          r"logging.memory: auto"):
        validate_recipe(tiny_recipe(tmp_path / "x", compile={"enabled": True}, logging={"memory": "tracked"}))
    torch._dynamo.reset()
