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
