"""Activation offloading on its CUDA path (pinned host buffers, copies on a side stream, prefetch in backward):
what moves, that the GPU holds less, and that gradients are bitwise those of the run without offloading. Skipped with
the reason on a machine without a GPU; test_offload.py checks the same bookkeeping on the CPU."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from ckpt_models import assert_same_grads, batch, step_grads, tiny_model
from test_offload import DIM, Chain, assert_equal_grads, grads_of

from remat.checkpointing import apply_activation_checkpointing
from remat.checkpointing.offload import OffloadActivations

pytestmark = pytest.mark.gpus(1)

STAGES = 8
ROWS = 16384
ACT_BYTES = ROWS * DIM * 4  # one [16384, 64] float32 activation: 4 MiB, above the default 1 MiB threshold


def _peak_of(run: Callable[[], object]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def test_pinned_offload_on_a_side_stream_moves_activations_and_keeps_gradients() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    model = Chain(STAGES).to(device)
    x = torch.randn(ROWS, DIM, device=device) * 2
    expected: list[torch.Tensor] = []
    plain_peak = _peak_of(lambda: expected.extend(grads_of(model, lambda: model(x))))

    off = OffloadActivations(module=model)  # the defaults: pinned buffers, side stream, prefetch 2
    got: list[torch.Tensor] = []
    host_pinned: list[bool] = []

    def offloaded() -> torch.Tensor:
        with off:
            out = model(x)
        host_pinned.extend(copy.host.is_pinned() for _, ref in off._order if (copy := ref()) is not None)
        return out

    offload_peak = _peak_of(lambda: got.extend(grads_of(model, offloaded)))
    assert_equal_grads(expected, got)
    # Saved: x and each stage's tanh output (also the next matmul's input: one copy); the STAGES - 1 weights that
    # matmuls save (16 KiB each) stay, below the 1 MiB threshold.
    assert (off.stats.offloaded_tensors, off.stats.offloaded_bytes) == (STAGES + 1, (STAGES + 1) * ACT_BYTES)
    assert off.stats.deduplicated == STAGES - 1 and off.stats.skipped == {"small": STAGES - 1}
    assert (off.stats.restored_tensors, off.stats.restored_bytes) == (STAGES + 1, (STAGES + 1) * ACT_BYTES)
    assert off.stats.prefetched > 0  # backward restored some copies ahead of time, on the side stream
    assert host_pinned and all(host_pinned)
    assert off.host_bytes == 0  # every host copy died with backward
    assert offload_peak <= plain_peak - 3 * ACT_BYTES, (offload_peak, plain_peak)


@pytest.mark.parametrize("policy", ["offload", {"mode": "full", "offload": True}], ids=["offload", "full+offload"])
def test_offload_policies_on_a_gpu_model_move_what_they_save_and_keep_gradients(policy: object) -> None:
    """``offload`` keeps every tensor a block saves, on the host (its attention and MLP activations: dozens per
    layer); ``full`` + offload saves only each block's input, the hidden states, and moves those (first GPU run,
    2026-11-26: 78 and 4 tensors on the tiny Llama, as the CPU bookkeeping with ``copy_cpu_tensors`` counts)."""
    model = tiny_model("llama").cuda()
    ids = batch().cuda()
    expected = step_grads(model, ids)
    context = OffloadActivations(min_bytes=0, module=model)  # pinned, side stream; tiny tensors count here
    plan = apply_activation_checkpointing(model, policy, offload_context=context)
    assert_same_grads(expected, step_grads(model, ids))
    layers = model.config.num_hidden_layers
    if policy == "offload":
        assert context.stats.offloaded_tensors > 10 * layers and context.stats.skipped["parameter"] > 0
    else:
        assert context.stats.offloaded_tensors == layers  # each block's hidden_states
    assert context.stats.restored_tensors == context.stats.offloaded_tensors
    assert plan.offload_context is context
