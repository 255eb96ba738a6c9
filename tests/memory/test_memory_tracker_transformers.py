"""LiveTensorTracker on a tiny transformers Llama: HF activation checkpointing, fake tensors equal real ones."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoConfig, AutoModelForCausalLM

from remat.checkpointing.hf_native import enable_hf_checkpointing
from remat.memory import LiveTensorTracker

BATCH, SEQ, VOCAB = 2, 16, 64


def _llama_step(*, checkpointed: bool, fake: bool) -> tuple[LiveTensorTracker, int]:
    config = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    with FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        if checkpointed:
            enable_hf_checkpointing(model)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ))
        # Left padding in one row: with an all-ones mask the real model would skip building the attention mask
        # (it reads the mask's values), which fake tensors cannot do.
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, :3] = 0
        with LiveTensorTracker(module=model, optimizer=optimizer) as tracker:
            loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
            tracker.mark("after_forward")
            loss.backward()
            tracker.mark("after_backward")
            optimizer.step()
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return tracker, param_bytes


@pytest.fixture(scope="module")
def steps() -> dict[tuple[bool, bool], tuple[LiveTensorTracker, int]]:
    return {(ckpt, fake): _llama_step(checkpointed=ckpt, fake=fake) for ckpt in (False, True) for fake in (False, True)}


def test_checkpointing_lowers_only_the_post_forward_bytes(steps: dict) -> None:
    plain, param_bytes = steps[(False, False)]
    checkpointed, _ = steps[(True, False)]
    assert checkpointed.marks["after_forward"] < plain.marks["after_forward"] - param_bytes // 2
    assert checkpointed.marks["after_backward"] == plain.marks["after_backward"]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_fake_tensor_step_matches_the_real_one(steps: dict, checkpointed: bool) -> None:
    real, param_bytes = steps[(checkpointed, False)]
    fake, fake_param_bytes = steps[(checkpointed, True)]
    assert fake_param_bytes == param_bytes
    assert (fake.marks, fake.peak_bytes, fake.peak_breakdown) == (real.marks, real.peak_bytes, real.peak_breakdown)
    assert real.peak_breakdown["parameters"] == real.peak_breakdown["gradients"] == param_bytes
    assert sum(real.peak_breakdown.values()) == real.peak_bytes
