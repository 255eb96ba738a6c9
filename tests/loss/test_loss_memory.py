"""The fused loss never materialises the logits, its working memory is its chunk budget, its FLOPs are as stated."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from remat.loss import FusedLinearCrossEntropy, MaskedCrossEntropy
from remat.loss.chunked import MIN_CHUNK, bytes_per_logit
from remat.memory import LiveTensorTracker

BATCH, SEQ, HIDDEN, VOCAB = 2, 1024, 8, 8192
TOKENS = BATCH * SEQ


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor (by element count) that any aten op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0
        self.op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, Tensor) and item.numel() > self.numel:
                self.numel, self.op = item.numel(), str(func)
        return out


def _inputs(dtype: torch.dtype = torch.float32, prompt: int = 0, vocab: int = VOCAB) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(vocab, HIDDEN, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    labels[:, :prompt] = -100
    return hidden, weight, labels


def _plain(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    return MaskedCrossEntropy()(F.linear(hidden, weight), labels)


@pytest.mark.parametrize(
    ("dtype", "strategy", "softcap"),
    [(torch.float32, "auto", None), (torch.float32, "recompute", 30.0), (torch.bfloat16, "auto", None)],
)
def test_no_tensor_as_large_as_the_logits_in_forward_and_backward(dtype, strategy, softcap) -> None:
    hidden, weight, labels = _inputs(dtype)
    chunk_bytes = 32 * 2**20  # 512 to 1024 rows of the vocabulary: several chunks, none of them clamped to MIN_CHUNK
    assert chunk_bytes // (VOCAB * bytes_per_logit(dtype, softcap)) >= MIN_CHUNK
    fused = FusedLinearCrossEntropy(logit_softcap=softcap, grad_strategy=strategy, chunk_bytes=chunk_bytes)
    with LargestOutput() as probe:
        fused(hidden, weight, labels).backward()
    assert probe.numel < TOKENS * VOCAB, probe.op
    assert probe.numel * bytes_per_logit(dtype, softcap) <= chunk_bytes, probe.op
    assert weight.grad is not None and hidden.grad is not None
    with LargestOutput() as plain_probe:  # the probe does see the logits of the plain loss
        _plain(hidden, weight, labels).backward()
    assert plain_probe.numel >= TOKENS * VOCAB


def test_working_memory_is_one_chunk_and_a_small_fraction_of_the_plain_loss() -> None:
    hidden, weight, labels = _inputs()
    chunk_bytes = 16 * 2**20  # 512 rows of the vocabulary

    def working_peak(loss_fn) -> int:
        hidden.grad = weight.grad = None
        with LiveTensorTracker() as tracker:
            loss_fn().backward()
        return tracker.peak_bytes - hidden.numel() * 4 - weight.numel() * 4  # minus the returned gradients

    fused = working_peak(lambda: FusedLinearCrossEntropy(chunk_bytes=chunk_bytes)(hidden, weight, labels))
    plain = working_peak(lambda: _plain(hidden, weight, labels))
    logits_bytes = TOKENS * VOCAB * 4
    assert plain >= 2 * logits_bytes
    assert fused <= chunk_bytes * 1.05
    assert fused <= 0.1 * plain  # one 512-row chunk of 2047 label rows vs three logits-sized tensors


def _matmul_flops(run) -> int:
    with FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


@pytest.mark.parametrize(("strategy", "matmuls"), [("forward", 3), ("recompute", 4)])
def test_flops_are_three_or_four_matmuls_over_label_tokens_only(strategy, matmuls) -> None:
    vocab = 2048
    hidden, weight, labels = _inputs(prompt=128, vocab=vocab)
    label_tokens = int((labels[:, 1:] != -100).sum())
    one_matmul = 2 * label_tokens * vocab * HIDDEN
    fused = FusedLinearCrossEntropy(chunk_size=256, grad_strategy=strategy, chunk_bytes=2**20)
    assert _matmul_flops(lambda: fused(hidden, weight, labels).backward()) == matmuls * one_matmul
    with torch.no_grad():
        assert _matmul_flops(lambda: fused(hidden, weight, labels)) == one_matmul
    frozen_head = weight.detach()
    assert _matmul_flops(lambda: fused(hidden, frozen_head, labels).backward()) == (matmuls - 1) * one_matmul
    plain = _matmul_flops(lambda: _plain(hidden, weight, labels).backward())
    assert plain == 3 * 2 * TOKENS * vocab * HIDDEN  # the plain loss also multiplies the ignored tokens
