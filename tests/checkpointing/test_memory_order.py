"""Activation memory is measured, not assumed: the exact live-tensor tracker orders the policies as they must be."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch

from remat.checkpointing import apply_activation_checkpointing
from remat.memory import LiveTensorTracker

# Llama, hidden H=64, MLP width I=4H=256, 4 layers, batch 2, seq S=64, no dropout. Per layer and token, no
# checkpointing keeps every saved activation: the attention part (norm, q/k/v, rotary, SDPA output and its
# log-sum-exp, o_proj input: about 8 H) and the MLP part (norm, gate, up, SiLU, product: about 4 I = 16 H). Full
# keeps one H-wide block input per layer. Selective keeps the attention outputs and every other matmul output but
# recomputes the element-wise ops (norms, rotary, SiLU, products), so it lands between the two. Recomputing only
# the attention keeps the MLP part, recomputing only the MLP keeps the attention part: both between none and full,
# and with I = 4H the MLP part is the larger one. Segments of 2 blocks keep 2 block inputs instead of 4.
HIDDEN, SEQ, BATCH, LAYERS = 64, 64, 2, 4
BLOCK_INPUT_BYTES = BATCH * SEQ * HIDDEN * 4  # one fp32 hidden state


def _model() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, max_position_embeddings=SEQ,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    return model.train()


@functools.cache
def measure(policy_key: str) -> tuple[int, int]:
    """(bytes alive after forward, peak bytes of forward + backward) under ``policy``, parameters included."""
    policy: Any = {"every_n_2": {"every_n_layers": 2}}.get(policy_key, policy_key)
    model = _model()
    apply_activation_checkpointing(model, policy)
    ids = torch.randint(3, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with LiveTensorTracker(module=model) as tracker:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        tracker.mark("after_forward")
        loss.backward()
    return tracker.marks["after_forward"], tracker.peak_bytes


def test_bytes_after_forward_none_gt_selective_gt_full() -> None:
    none, selective, full = (measure(p)[0] for p in ("none", "selective", "full"))
    assert none > selective > full
    # every saved activation of 4 layers vs. 4 block inputs: far apart, not a rounding effect
    assert none - full > 20 * LAYERS * BLOCK_INPUT_BYTES


@pytest.mark.parametrize("partial", ["attention", "mlp", "every_n_2"])
def test_partial_policies_lie_between_none_and_full(partial: str) -> None:
    assert measure("none")[0] > measure(partial)[0] > measure("full")[0]


def test_mlp_part_is_larger_than_attention_part_at_this_shape() -> None:
    # recomputing the MLP frees more than recomputing the attention when I = 4H and S = H
    assert measure("attention")[0] > measure("mlp")[0]


def test_segments_keep_only_segment_inputs() -> None:
    # 4 blocks in 2 segments: 2 block inputs instead of 4, exactly; during backward a segment's 2 blocks are live
    # together, so the peak is above full's and still below no checkpointing's.
    full_after, full_peak = measure("full")
    sqrt_after, sqrt_peak = measure("sqrt")
    assert full_after - sqrt_after == 2 * BLOCK_INPUT_BYTES
    assert full_peak < sqrt_peak < measure("none")[1]


def test_peaks_follow_the_same_order() -> None:
    assert measure("none")[1] > measure("selective")[1] > measure("full")[1]


def test_offload_on_the_cpu_moves_nothing() -> None:
    # On a CPU-only machine host memory is the memory: the default offload context leaves CPU tensors in place.
    assert measure("offload") == measure("none")
