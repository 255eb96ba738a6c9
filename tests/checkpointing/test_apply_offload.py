"""Offloading policies, tested honestly on a CPU-only machine: with an offload context that copies CPU tensors, what
is moved, that it comes back for backward, and that gradients are unchanged. (The memory benefit needs a GPU.)"""

from __future__ import annotations

import pytest
import torch
from ckpt_models import BATCH, SEQ, assert_same_grads, batch, step_grads, tiny_model

from remat.checkpointing import apply_activation_checkpointing
from remat.checkpointing.offload import OffloadActivations

HIDDEN = 32
LAYERS = 4


def _copying_context(model: torch.nn.Module) -> OffloadActivations:
    return OffloadActivations(copy_cpu_tensors=True, min_bytes=0, prefetch=0, module=model)


def test_offload_mode_moves_what_blocks_save_and_brings_it_back() -> None:
    model = tiny_model("llama")
    ids = batch()
    expected = step_grads(model, ids)
    context = _copying_context(model)
    plan = apply_activation_checkpointing(model, "offload", offload_context=context)
    assert plan.offload_context is context
    actual = step_grads(model, ids)
    assert_same_grads(expected, actual)
    stats = context.stats
    assert stats.offloaded_tensors > 10 * LAYERS  # every activation a block saves, not just its input
    assert stats.restored_tensors == stats.offloaded_tensors
    assert stats.restored_bytes == stats.offloaded_bytes
    assert stats.skipped["parameter"] > 0  # weights stay where they are


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_with_offload_moves_exactly_the_block_inputs(mode: str) -> None:
    model = tiny_model("qwen3")
    ids = batch()
    expected = step_grads(model, ids)
    context = _copying_context(model)
    apply_activation_checkpointing(model, {"mode": mode, "offload": True}, offload_context=context)
    actual = step_grads(model, ids)
    assert_same_grads(expected, actual)
    # checkpointing keeps one hidden state per block as its input; with offload those (and only those) go to the
    # host (what selective caches inside the block bypasses saved-tensor hooks and stays where it is)
    assert context.stats.offloaded_tensors == LAYERS
    assert context.stats.offloaded_bytes == LAYERS * BATCH * SEQ * HIDDEN * 4
    assert context.stats.restored_tensors == LAYERS


def test_attention_with_offload_moves_the_attention_inputs() -> None:
    model = tiny_model("mistral")
    ids = batch()
    expected = step_grads(model, ids)
    context = _copying_context(model)
    apply_activation_checkpointing(model, {"mode": "attention", "offload": True}, offload_context=context)
    assert_same_grads(expected, step_grads(model, ids))
    assert context.stats.offloaded_tensors == LAYERS  # the keyword-only hidden_states of each attention module


def test_default_context_on_the_cpu_copies_nothing() -> None:
    model = tiny_model("llama")
    plan = apply_activation_checkpointing(model, "offload")
    step_grads(model, batch())
    assert plan.offload_context.stats.offloaded_tensors == 0
    assert plan.offload_context.stats.skipped["host"] > 0


def test_offload_as_a_per_layer_exception() -> None:
    model = tiny_model("llama")
    ids = batch()
    expected = step_grads(model, ids)
    context = _copying_context(model)
    plan = apply_activation_checkpointing(model, {"mode": "full", "layers": {"3": "offload"}}, offload_context=context)
    assert [(layer.mode, layer.offload) for layer in plan] == [("full", False)] * 3 + [("offload", True)]
    assert_same_grads(expected, step_grads(model, ids))
    assert context.stats.offloaded_tensors > 10  # what block 3 saves
