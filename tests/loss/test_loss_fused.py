"""FusedLinearCrossEntropy: loss and gradients against the float64 reference of the plain loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loss_reference import loss_and_grads, plain_head_loss, random_labels, reference_loss
from torch import Tensor

from remat.loss import FusedLinearCrossEntropy, chunked

B, T, H, V = 2, 33, 24, 257


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let tiny chunk_bytes give tiny vocabulary slices too (the library keeps at least 256 for speed)."""
    monkeypatch.setattr(chunked, "MIN_CHUNK", 4)


def _inputs(seed: int, dtype: torch.dtype = torch.float64, bias: bool = True, ignore: float = 0.3,
            shape: tuple[int, int, int, int] = (B, T, H, V)) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    batch, seq, hidden, vocab = shape
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=generator)
    w = torch.randn(vocab, hidden, generator=generator) * (3 / hidden**0.5)
    b = torch.randn(vocab, generator=generator) if bias else None
    labels = random_labels((batch, seq), vocab, ignore, generator)
    return h.to(dtype), w.to(dtype), b.to(dtype) if b is not None else None, labels


def _fused(strategy: str, softcap: float | None = None, reduction: str = "mean", **kw) -> FusedLinearCrossEntropy:
    # small chunks so that every path runs over several token chunks and vocabulary slices
    return FusedLinearCrossEntropy(reduction=reduction, logit_softcap=softcap, chunk_size=8,
                                   grad_strategy=strategy, chunk_bytes=4096, **kw)


def _rel_err(value: Tensor, ref: Tensor) -> float:
    return float((value.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def _compare(h, w, b, labels, strategy, softcap, reduction, num_label_tokens=None):
    leaves = [h.requires_grad_(), w.requires_grad_(), b.requires_grad_() if b is not None else None]
    fused = _fused(strategy, softcap, reduction)
    loss, grads = loss_and_grads(lambda hh, ww, bb: fused(hh, ww, labels, bias=bb, num_label_tokens=num_label_tokens),
                                 leaves)
    ref, ref_grads = loss_and_grads(
        lambda hh, ww, bb: reference_loss(hh, ww, labels, bb, softcap, reduction=reduction,
                                          num_label_tokens=num_label_tokens),
        [t.double().requires_grad_() if t is not None else None for t in leaves])
    return loss, grads, ref, ref_grads


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_matches_float64_reference(strategy, softcap, bias, reduction, dtype, tol) -> None:
    h, w, b, labels = _inputs(seed=hash((strategy, softcap, bias, reduction)) % 1000, dtype=dtype, bias=bias)
    loss, grads, ref, ref_grads = _compare(h, w, b, labels, strategy, softcap, reduction)
    assert loss.dtype == torch.promote_types(dtype, torch.float32)
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        if ref_grad is None:
            assert grad is None
            continue
        assert grad.dtype == dtype
        assert _rel_err(grad, ref_grad) <= tol


# bf16 inputs: the logits of a bf16 matmul are rounded to bf16 before the fp32 softmax, in the plain loss too. The
# stated tolerance: relative error (norm-wise) below 1e-2 and at most 1.5x the plain bf16 loss's own error + 5e-4.
@pytest.mark.parametrize("strategy", ["forward", "recompute"])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_bf16_is_as_accurate_as_the_plain_bf16_loss(strategy, softcap) -> None:
    h, w, b, labels = _inputs(seed=7, dtype=torch.bfloat16)
    loss, grads, ref, ref_grads = _compare(h, w, b, labels, strategy, softcap, "mean")

    plain_loss, plain_grads = loss_and_grads(plain_head_loss(labels, softcap), [h, w, b])
    assert loss.dtype == torch.float32
    loss_err, plain_loss_err = abs(loss.item() - ref.item()), abs(plain_loss.item() - ref.item())
    assert loss_err <= 1e-2 * ref.item() and loss_err <= 1.5 * plain_loss_err + 5e-4
    for grad, plain_grad, ref_grad in zip(grads, plain_grads, ref_grads, strict=True):
        assert grad.dtype == torch.bfloat16
        assert _rel_err(grad, ref_grad) <= min(1e-2, 1.5 * _rel_err(plain_grad, ref_grad) + 5e-4)


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
def test_all_ignored_batch_gives_zero_loss_and_zero_grads(strategy) -> None:
    h, w, b, labels = _inputs(seed=1, dtype=torch.float32)
    labels = torch.full_like(labels, -100)
    labels[:, 0] = 5  # the first label is never a target
    loss, grads, _, _ = _compare(h, w, b, labels, strategy, 2.0, "mean")
    assert loss.item() == 0.0
    for grad in grads:
        assert grad is not None and torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
def test_all_ignored_rows_and_custom_ignore_index(strategy) -> None:
    h, w, b, labels = _inputs(seed=2)
    labels = labels.masked_fill(labels == -100, 0)
    labels[0] = 0  # a whole row ignored
    fused = _fused(strategy, ignore_index=0)
    loss = fused(h, w, labels, bias=b)
    ref = reference_loss(h, w, labels, b, ignore_index=0)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
def test_num_label_tokens_divides_the_summed_loss(strategy) -> None:
    h, w, b, labels = _inputs(seed=3)
    loss, grads, ref, ref_grads = _compare(h, w, b, labels, strategy, None, "mean", num_label_tokens=1000)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=0)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-15)


def test_gradient_accumulation_over_micro_batches_equals_one_big_batch() -> None:
    h, w, _, labels = _inputs(seed=4, shape=(4, 9, 8, 31))
    count = int((labels[:, 1:] != -100).sum())
    big = w.clone().requires_grad_()
    FusedLinearCrossEntropy(chunk_size=4)(h, big, labels).backward()
    micro = w.clone().requires_grad_()
    for rows in (slice(0, 1), slice(1, 4)):
        FusedLinearCrossEntropy(chunk_size=4)(h[rows], micro, labels[rows], num_label_tokens=count).backward()
    torch.testing.assert_close(micro.grad, big.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
def test_tied_embedding_collects_the_gradients_of_both_uses(strategy) -> None:
    torch.manual_seed(0)
    vocab, hidden = 41, 12
    ids = torch.randint(0, vocab, (2, 7))
    labels = ids.masked_fill(torch.rand(2, 7) < 0.2, -100)
    mixer = torch.randn(hidden, hidden, dtype=torch.float64)
    shared = torch.randn(vocab, hidden, dtype=torch.float64)

    def run(loss_of_hidden):
        weight = shared.clone().requires_grad_()
        hidden_states = torch.tanh(F.embedding(ids, weight) @ mixer)  # the same tensor embeds and projects
        loss_of_hidden(hidden_states, weight).backward()
        return weight.grad

    fused = run(lambda hs, weight: _fused(strategy)(hs, weight, labels))
    ref = run(lambda hs, weight: reference_loss(hs, weight, labels))
    embedding_only = run(lambda hs, weight: reference_loss(hs, weight.detach(), labels))
    torch.testing.assert_close(fused, ref, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(ref, embedding_only)  # both uses contribute


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
def test_incoming_gradient_scales_the_gradients(strategy) -> None:
    h, w, b, labels = _inputs(seed=5)
    leaves = [h.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()]
    (-3.0 * _fused(strategy)(*leaves[:2], labels, bias=leaves[2])).backward()
    _, ref_grads = loss_and_grads(lambda hh, ww, bb: reference_loss(hh, ww, labels, bb), leaves)
    for leaf, ref_grad in zip(leaves, ref_grads, strict=True):
        torch.testing.assert_close(leaf.grad, -3.0 * ref_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("strategy", ["forward", "recompute"])
@pytest.mark.parametrize("trainable", ["hidden", "weight"])
def test_frozen_inputs_get_no_gradient(strategy, trainable) -> None:
    h, w, _, labels = _inputs(seed=6)
    h.requires_grad_(trainable == "hidden")
    w.requires_grad_(trainable == "weight")
    _fused(strategy)(h, w, labels).backward()
    _, (ref_h, ref_w) = loss_and_grads(lambda hh, ww: reference_loss(hh, ww, labels), [h, w])
    live, ref, frozen = (h, ref_h, w) if trainable == "hidden" else (w, ref_w, h)
    assert frozen.grad is None
    torch.testing.assert_close(live.grad, ref, rtol=1e-12, atol=1e-15)


def test_forward_strategy_refuses_a_second_backward_and_recompute_allows_it() -> None:
    h, w, _, labels = _inputs(seed=8)
    w.requires_grad_()
    loss = _fused("forward")(h, w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="grad_strategy='recompute'"):
        loss.backward()
    w.grad = None
    loss = _fused("recompute")(h, w, labels)
    loss.backward(retain_graph=True)
    once = w.grad.clone()
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * once, rtol=1e-12, atol=0)


def test_no_grad_returns_the_loss() -> None:
    h, w, b, labels = _inputs(seed=9)
    w.requires_grad_()
    with torch.no_grad():
        loss = FusedLinearCrossEntropy(chunk_size=8)(h, w, labels, bias=b)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference_loss(h, w, labels, b), rtol=1e-12, atol=0)


def test_two_dimensional_hidden_states_are_one_sequence() -> None:
    h, w, _, labels = _inputs(seed=10)
    single = FusedLinearCrossEntropy(chunk_size=8)(h[0], w, labels[0])
    torch.testing.assert_close(single, reference_loss(h[0], w, labels[0]), rtol=1e-12, atol=0)


def test_autocast_casts_like_a_linear_layer_and_grads_reach_fp32_parameters() -> None:
    h, w, _, labels = _inputs(seed=11, dtype=torch.float32)
    weight = w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = FusedLinearCrossEntropy(chunk_size=8)(h, weight, labels)
    loss.backward()
    assert weight.grad.dtype == torch.float32
    _, (ref_grad,) = loss_and_grads(lambda ww: reference_loss(h.bfloat16(), ww.bfloat16(), labels),
                                    [w.double().requires_grad_()])
    assert abs(loss.item() - reference_loss(h.bfloat16(), w.bfloat16(), labels).item()) < 1e-2
    assert _rel_err(weight.grad, ref_grad) < 1e-2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    batch=st.integers(1, 3), seq=st.integers(1, 20), hidden=st.integers(1, 9), vocab=st.integers(2, 70),
    chunk=st.integers(1, 25), chunk_bytes=st.integers(1, 4000), ignore=st.sampled_from([0.0, 0.5, 0.95, 1.0]),
    softcap=st.sampled_from([None, 0.7, 30.0]), reduction=st.sampled_from(["mean", "sum"]),
    strategy=st.sampled_from(["auto", "forward", "recompute"]), bias=st.booleans(), seed=st.integers(0, 2**16),
)
def test_property_fused_equals_reference_for_any_shape_and_chunking(
    batch, seq, hidden, vocab, chunk, chunk_bytes, ignore, softcap, reduction, strategy, bias, seed
) -> None:
    h, w, b, labels = _inputs(seed, bias=bias, ignore=ignore, shape=(batch, seq, hidden, vocab))
    fused = FusedLinearCrossEntropy(reduction=reduction, logit_softcap=softcap, chunk_size=chunk,
                                    grad_strategy=strategy, chunk_bytes=chunk_bytes)
    leaves = [h.requires_grad_(), w.requires_grad_(), b.requires_grad_() if b is not None else None]
    loss, grads = loss_and_grads(lambda hh, ww, bb: fused(hh, ww, labels, bias=bb), leaves)
    ref, ref_grads = loss_and_grads(lambda hh, ww, bb: reference_loss(hh, ww, labels, bb, softcap,
                                                                      reduction=reduction), leaves)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        if ref_grad is not None:
            assert torch.isfinite(grad).all()
            torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
