"""LiveTensorTracker through autograd: backward, checkpointing (full and selective), optimizer, fake tensors."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from remat.memory import LiveTensorTracker

F32 = 4
DIM, BATCH, LAYERS = 16, 8, 3
PARAM_BYTES = LAYERS * (DIM * 4 * DIM + 4 * DIM + 4 * DIM * DIM + DIM) * F32


class Block(nn.Module):
    """x + W2 relu(W1 x): keeps the relu output (4*DIM wide) and the block output (DIM wide) for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _save_only_relu(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.relu.default else CheckpointPolicy.PREFER_RECOMPUTE


def _run_block(block: nn.Module, h: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "none":
        return block(h)
    if mode == "full":
        return checkpoint(block, h, use_reentrant=False)
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_only_relu)
    return checkpoint(block, h, use_reentrant=False, context_fn=context_fn)


def _train_step(mode: str, *, with_baseline: bool, fake: bool = False) -> LiveTensorTracker:
    """One forward/backward/AdamW step of the block stack; with `fake`, all of it on fake tensors."""
    with FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(0)
        model = nn.Sequential(*[Block() for _ in range(LAYERS)])
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
        x = torch.randn(BATCH, DIM)
        tracker = LiveTensorTracker(module=model, optimizer=optimizer) if with_baseline else LiveTensorTracker()
        with tracker:
            h = x
            for block in model:
                h = _run_block(block, h, mode)
            loss = h.pow(2).mean()
            tracker.mark("after_forward")
            loss.backward()
            tracker.mark("after_backward")
            optimizer.step()
            tracker.mark("after_step")
    return tracker


def test_post_forward_bytes_match_what_autograd_keeps() -> None:
    relu_out, block_out, loss = BATCH * 4 * DIM * F32, BATCH * DIM * F32, F32
    plain = _train_step("none", with_baseline=False)
    full = _train_step("full", with_baseline=False)
    assert plain.marks["after_forward"] == LAYERS * (relu_out + block_out) + loss
    assert full.marks["after_forward"] == LAYERS * block_out + loss
    assert plain.marks["after_forward"] - full.marks["after_forward"] == LAYERS * relu_out


def test_selective_policy_keeps_exactly_the_saved_op_outputs() -> None:
    selective = _train_step("selective", with_baseline=False)
    full = _train_step("full", with_baseline=False)
    assert selective.marks["after_forward"] - full.marks["after_forward"] == LAYERS * BATCH * 4 * DIM * F32


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_backward_and_optimizer_step_are_seen_with_baselines(mode: str) -> None:
    tracker = _train_step(mode, with_baseline=True)
    block_out, loss = BATCH * DIM * F32, F32
    adamw_step_counters = LAYERS * 4 * F32  # one float32 "step" tensor per parameter
    held_by_caller = block_out + loss  # `h` and `loss`; everything saved for backward is gone after it
    assert tracker.marks["after_backward"] == 2 * PARAM_BYTES + held_by_caller
    assert tracker.marks["after_step"] == 4 * PARAM_BYTES + adamw_step_counters + held_by_caller
    breakdown = tracker.peak_breakdown
    assert sum(breakdown.values()) == tracker.peak_bytes
    assert breakdown["parameters"] == breakdown["gradients"] == PARAM_BYTES
    assert breakdown["optimizer_state"] == 2 * PARAM_BYTES + adamw_step_counters
    assert breakdown["temporaries"] > 0  # the foreach update's intermediates make this step's peak
    assert tracker.peak_phase == "after_backward"


def test_recompute_during_backward_is_tracked() -> None:
    """Full checkpointing recomputes relu outputs in backward; the backward peak sits above the stored bytes."""
    full = _train_step("full", with_baseline=False)
    relu_out = BATCH * 4 * DIM * F32
    # During the backward of the last block its recomputed relu output, the previous blocks' outputs and the
    # gradients accumulated so far are alive together: above the post-backward gradients plus one relu output.
    assert full.peak_bytes >= full.marks["after_backward"] - 2 * PARAM_BYTES + relu_out
    assert full.peak_bytes > full.marks["after_forward"] + relu_out


def test_saved_tensors_become_activations_when_backward_starts() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    at_first_backward_op: list[dict[str, int]] = []
    with LiveTensorTracker() as tracker:
        hidden = torch.tanh(x @ weight)  # tanh saves its output; the matmul output is a freed temporary
        hidden.register_hook(lambda grad: at_first_backward_op.append(tracker.current_breakdown))
        loss = hidden.sum()
        del hidden
        forward_peak = tracker.peak_breakdown
        loss.backward()
        after_backward = tracker.current_breakdown
    hidden_bytes, loss_and_seed_grad = 32 * 64 * F32, 2 * F32
    assert forward_peak["temporaries"] == 2 * hidden_bytes  # matmul output and tanh output, both alive
    assert forward_peak["activations"] == 0
    # When backward began, the tanh output (saved), the loss and backward's seed gradient were alive.
    assert at_first_backward_op[0]["activations"] == hidden_bytes + loss_and_seed_grad
    assert after_backward["activations"] == F32  # only the loss, still held by the caller
    assert after_backward["temporaries"] == 64 * 64 * F32  # weight.grad: no module was given to classify it
    assert sum(tracker.peak_breakdown.values()) == tracker.peak_bytes


@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_fake_tensors_give_the_same_figures_as_real_ones(mode: str) -> None:
    real = _train_step(mode, with_baseline=True)
    fake = _train_step(mode, with_baseline=True, fake=True)
    assert fake.marks == real.marks
    assert fake.peak_bytes == real.peak_bytes
    assert fake.peak_breakdown == real.peak_breakdown
    assert fake.marks["after_forward"] > PARAM_BYTES


def test_gradient_accumulation_counts_each_micro_batch_saved_tensors_as_activations() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(LAYERS)])
    batches = [torch.randn(BATCH, DIM) for _ in range(2)]
    saved_per_batch = LAYERS * (BATCH * 4 * DIM + BATCH * DIM) * F32
    at_backward_start: list[dict[str, int]] = []
    with LiveTensorTracker(module=model) as tracker:
        for index, x in enumerate(batches):
            loss = model(x).pow(2).mean()
            loss.register_hook(lambda grad: at_backward_start.append(tracker.current_breakdown))
            loss.backward()
            tracker.mark(f"after_backward_{index}")
            del loss
    loss_and_seed_grad = 2 * F32
    assert [b["activations"] for b in at_backward_start] == [saved_per_batch + loss_and_seed_grad] * 2
    assert [b["gradients"] for b in at_backward_start] == [0, PARAM_BYTES]
    assert tracker.marks == {"after_backward_0": 2 * PARAM_BYTES + F32, "after_backward_1": 2 * PARAM_BYTES + F32}
