"""MaskedCrossEntropy: the plain loss against the float64 reference, HF's own loss, and its error messages."""

from __future__ import annotations

import pytest
import torch
from loss_reference import random_labels, reference_loss_from_logits
from transformers import AutoConfig, AutoModelForCausalLM

from remat.errors import ConfigError
from remat.loss import MaskedCrossEntropy
from remat.loss.targets import next_token_targets


def _logits_and_labels(seed: int = 0, shape: tuple[int, ...] = (3, 11), vocab: int = 29, ignore: float = 0.3):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=generator, dtype=torch.float64) * 3
    return logits, random_labels(shape, vocab, ignore, generator)


def test_next_token_targets_shift_left_and_pad_with_ignore_index() -> None:
    labels = torch.tensor([[5, 6, 7], [8, -100, 9]])
    assert next_token_targets(labels, -100).tolist() == [6, 7, -100, -100, 9, -100]
    assert next_token_targets(torch.tensor([1, 2]), -1).tolist() == [2, -1]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(3, 11), (17,), (2, 2, 5)])
def test_matches_float64_reference(reduction: str, shape: tuple[int, ...]) -> None:
    logits, labels = _logits_and_labels(shape=shape)
    logits.requires_grad_()
    loss = MaskedCrossEntropy(reduction=reduction)(logits, labels)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = reference_loss_from_logits(ref_logits, labels, reduction=reduction)
    (ref_grad,) = torch.autograd.grad(ref, ref_logits)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


def test_bf16_logits_give_an_fp32_loss_close_to_the_reference() -> None:
    logits, labels = _logits_and_labels(seed=1)
    loss = MaskedCrossEntropy()(logits.bfloat16(), labels)
    assert loss.dtype == torch.float32
    ref = reference_loss_from_logits(logits.bfloat16().double(), labels)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)


def test_num_label_tokens_divides_the_sum_and_accumulates_like_one_big_batch() -> None:
    logits, labels = _logits_and_labels(seed=2, shape=(4, 9))
    big = logits.detach().clone().requires_grad_()
    MaskedCrossEntropy()(big, labels).backward()
    count = int((labels[:, 1:] != -100).sum())
    micro = logits.detach().clone().requires_grad_()
    for rows in (slice(0, 1), slice(1, 4)):  # uneven micro-batches with different label counts
        MaskedCrossEntropy()(micro[rows], labels[rows], num_label_tokens=torch.tensor(count)).backward()
    torch.testing.assert_close(micro.grad, big.grad, rtol=1e-12, atol=1e-14)
    half = MaskedCrossEntropy()(logits, labels, num_label_tokens=2 * count)
    torch.testing.assert_close(half * 2, MaskedCrossEntropy()(logits, labels), rtol=1e-12, atol=0)


def test_all_ignored_gives_zero_loss_and_zero_grads() -> None:
    logits, _ = _logits_and_labels()
    logits.requires_grad_()
    labels = torch.full(logits.shape[:-1], -100)
    labels[:, 0] = 3  # the first label of a row is never predicted: still nothing to learn
    loss = MaskedCrossEntropy()(logits, labels)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_custom_ignore_index() -> None:
    logits, labels = _logits_and_labels(seed=3)
    relabelled = labels.masked_fill(labels == -100, 0)
    ref = reference_loss_from_logits(logits, relabelled, ignore_index=0)
    torch.testing.assert_close(MaskedCrossEntropy(ignore_index=0)(logits, relabelled), ref, rtol=1e-12, atol=0)


def test_equals_the_loss_of_a_hugging_face_model() -> None:
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 61, (2, 10))
    labels = ids.masked_fill(torch.arange(10) < 3, -100)  # prompt masking
    out = model(input_ids=ids, labels=labels)
    torch.testing.assert_close(MaskedCrossEntropy()(out.logits, labels), out.loss, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: MaskedCrossEntropy(reduction="none"), "loss_fn.reduction: got 'none'"),
        (lambda: MaskedCrossEntropy()(torch.randn(2, 5, 7), torch.zeros(2, 4, dtype=torch.long)),
         r"labels: got shape \(2, 4\)"),
        (lambda: MaskedCrossEntropy()(torch.randn(2, 5, 7), torch.zeros(2, 5)), "labels: got dtype torch.float32"),
        (lambda: MaskedCrossEntropy()(torch.randn(2, 5, 7), torch.full((2, 5), 7)), r"labels: got token id 7"),
        (lambda: MaskedCrossEntropy()(torch.randn(2, 5, 7), torch.ones(2, 5, dtype=torch.long),
                                      num_label_tokens=0), "num_label_tokens: got 0"),
        (lambda: MaskedCrossEntropy(reduction="sum")(torch.randn(2, 5, 7), torch.ones(2, 5, dtype=torch.long),
                                                     num_label_tokens=8), "reduction='sum'"),
        (lambda: MaskedCrossEntropy()(torch.randn(7), torch.ones(1, dtype=torch.long)), "logits: got shape"),
    ],
)
def test_mistakes_raise_config_errors_naming_the_argument(call, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()
