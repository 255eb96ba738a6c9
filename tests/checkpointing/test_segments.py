"""Segments: several blocks recomputed in backward as one unit from the segment input, whatever the model's loop does
between the blocks."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from ckpt_models import assert_same_grads, batch, step_grads, tiny_model
from custom_models import Block, TinyLM, lm_loss
from torch import nn

from remat.checkpointing import apply_activation_checkpointing
from remat.errors import CheckpointingError


def _grads(model: nn.Module, ids: torch.Tensor, loss_fn=lm_loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss_fn(model, ids).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_each_segment_is_replayed_once_and_as_a_unit() -> None:
    torch.manual_seed(0)
    model = TinyLM(layers=4)
    plan = apply_activation_checkpointing(model, "sqrt")
    assert plan.segments == ((0, 1), (2, 3))
    events: list[int] = []
    for i, block in enumerate(model.trunk.blocks):
        block.mlp.register_forward_pre_hook(lambda *_, i=i: events.append(i))
    loss = lm_loss(model, torch.randint(0, 64, (2, 12)))
    assert events == [0, 1, 2, 3]
    events.clear()
    loss.backward()
    # backward reaches block 3 first: the whole segment 2-3 is replayed (in forward order), then segment 0-1
    assert events == [2, 3, 0, 1]


class SkippingLM(TinyLM):
    """Skips block 1 (like layer-drop) and scales the hidden state between blocks with a parameter."""

    def __init__(self) -> None:
        super().__init__(layers=4)
        self.gains = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for i, block in enumerate(self.trunk.blocks):
            if i == 1:
                continue
            x = block(x) * self.gains[i]  # saved by the loop, outside any block: kept as usual
        return self.head(x)


def test_skipped_blocks_and_work_between_blocks_keep_gradients_exact() -> None:
    torch.manual_seed(0)
    model = SkippingLM()
    ids = torch.randint(0, 64, (2, 12))
    expected = _grads(model, ids)
    for segments in ("sqrt", 1):
        candidate = copy.deepcopy(model)
        apply_activation_checkpointing(candidate, {"segments": segments})
        assert_same_grads(expected, _grads(candidate, ids))


def test_intermediate_hidden_states_in_the_loss() -> None:
    model = tiny_model("llama")
    ids = batch()

    def loss_with_hidden(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        out = m(input_ids=ids, labels=ids, use_cache=False, output_hidden_states=True)
        return out.loss + out.hidden_states[2].pow(2).mean()  # the output of block 1, inside segment 0-1

    expected = _grads(model, ids, loss_with_hidden)
    apply_activation_checkpointing(model, "sqrt")
    assert_same_grads(expected, _grads(model, ids, loss_with_hidden))


def test_backward_twice_with_retain_graph() -> None:
    model = tiny_model("gpt2")
    ids = batch()
    expected = step_grads(model, ids)
    apply_activation_checkpointing(model, {"segments": 2})
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward(retain_graph=True)
    loss.backward()
    actual = {n: p.grad / 2 for n, p in model.named_parameters() if p.grad is not None}
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-6, atol=1e-7)


class ChangingBlock(Block):
    """Does something else the second time it runs: a replay cannot reproduce its forward."""

    calls = 0

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        ChangingBlock.calls += 1
        out = super().forward(x, scale)
        return out if ChangingBlock.calls % 2 else torch.tanh(out) * 2


def test_a_replay_that_differs_from_the_forward_is_an_error() -> None:
    model = TinyLM(layers=2)
    model.trunk.blocks[0] = ChangingBlock(32)  # not the last block: the replay of the last one stops early
    ChangingBlock.calls = 0
    apply_activation_checkpointing(model, {"segments": 1, "block_pattern": "trunk.blocks"})
    loss = lm_loss(model, torch.randint(0, 64, (2, 8)))
    with pytest.raises(CheckpointingError) as info:
        loss.backward()
    message = str(info.value)
    assert "segment 0-1: replaying block trunk.blocks.0 saved" in message
    assert "Use full or every_n_layers" in message


class FailingBlock(Block):
    fail = False

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        if FailingBlock.fail:
            raise RuntimeError("boom")
        return super().forward(x, scale)


def test_an_exception_mid_segment_leaves_no_half_open_run() -> None:
    torch.manual_seed(0)
    model = TinyLM(layers=3)
    model.trunk.blocks[1] = FailingBlock(32)
    ids = torch.randint(0, 64, (2, 8))
    expected = _grads(model, ids)
    apply_activation_checkpointing(model, {"segments": 1, "block_pattern": "trunk.blocks"})
    FailingBlock.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        lm_loss(model, ids)
    FailingBlock.fail = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same_grads(expected, _grads(model, ids))
