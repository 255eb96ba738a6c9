"""The torch backend's fast path (compiled chunk math, the default on CUDA): which path a device gets, exactness,
FLOPs, and the compile fallback. The chunk math runs uncompiled here except in one slow test that compiles it."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from loss_reference import loss_and_grads, plain_head_loss, random_labels, reference_loss
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from remat.loss import FusedLinearCrossEntropy, chunked, compiled
from remat.loss.chunked import FAST_CHUNK_BYTES, plan_chunks
from remat.loss.compiled import CompiledChunkMath, softmax_xent_grad_

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def eager_chunk_math(monkeypatch: pytest.MonkeyPatch) -> CompiledChunkMath:
    """The fast path with its chunk math run as plain PyTorch (no compile: seconds instead of a C++ build)."""
    math = CompiledChunkMath(compiler=lambda fn: fn)
    monkeypatch.setattr(chunked, "CHUNK_MATH", math)
    monkeypatch.setattr(chunked, "MIN_CHUNK", 4)
    return math


def _inputs(seed: int, dtype: torch.dtype, bias: bool, shape=(2, 33, 24, 257)):
    batch, seq, hidden, vocab = shape
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, seq, hidden, generator=generator).to(dtype)
    w = (torch.randn(vocab, hidden, generator=generator) * (3 / hidden**0.5)).to(dtype)
    b = torch.randn(vocab, generator=generator).to(dtype) if bias else None
    return h, w, b, random_labels((batch, seq), vocab, 0.3, generator)


def _rel_err(value: Tensor, ref: Tensor) -> float:
    return float((value.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def _run(fused, h, w, b, labels, softcap=None, reduction="mean"):
    leaves = [h.requires_grad_(), w.requires_grad_(), b.requires_grad_() if b is not None else None]
    got = loss_and_grads(lambda hh, ww, bb: fused(hh, ww, labels, bias=bb), leaves)
    ref = loss_and_grads(lambda hh, ww, bb: reference_loss(hh, ww, labels, bb, softcap, reduction=reduction),
                         [t.double().requires_grad_() if t is not None else None for t in leaves])
    return got, ref


@pytest.fixture
def triton_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan as on a GPU machine with Triton (this CPU machine has neither)."""
    monkeypatch.setattr("torch.utils._triton.has_triton", lambda: True)


def test_cuda_without_triton_keeps_the_eager_path(monkeypatch) -> None:
    monkeypatch.setattr("torch.utils._triton.has_triton", lambda: False)
    weight = torch.empty(128256, 2048, dtype=torch.bfloat16, device="meta", requires_grad=True)
    assert not compiled.compile_available(CUDA) and compiled.compile_available(CPU)
    assert not plan_chunks(CUDA, weight, 16384, None, "auto", None, None, None).fast


def test_cuda_gets_the_fast_path_with_bigger_chunks_and_the_cpu_keeps_the_eager_one(triton_present) -> None:
    weight = torch.empty(128256, 2048, dtype=torch.bfloat16, device="meta", requires_grad=True)
    on_cuda = plan_chunks(CUDA, weight, 16384, None, "auto", None, None, None)
    assert on_cuda.fast and on_cuda.strategy == "forward" and on_cuda.chunk_bytes == FAST_CHUNK_BYTES
    assert on_cuda.token_chunk == 768  # 768 rows x 128256 x 2 bytes = 188 MiB of bf16 logits, in place
    on_cpu = plan_chunks(CPU, weight, 16384, None, "auto", None, None, None)
    assert not on_cpu.fast and on_cpu.strategy == "recompute" and on_cpu.token_chunk == 512
    assert not plan_chunks(CUDA, weight, 16384, None, "auto", False, None, None).fast  # compile=False: eager
    recompute = plan_chunks(CUDA, weight, 16384, None, "recompute", None, None, None)
    assert not recompute.fast and recompute.strategy == "recompute"
    forced = plan_chunks(CPU, weight, 16384, 30.0, "auto", True, 300, 2**20)
    assert forced.fast and forced.token_chunk == 300 and forced.chunk_bytes == 2**20


def test_the_fast_path_is_chosen_by_the_loss_for_a_cuda_tensor(monkeypatch, triton_present) -> None:
    seen = []
    monkeypatch.setattr("remat.loss.fused.plan_chunks", lambda *args: seen.append(args) or plan_chunks(*args))
    h, w, _, labels = _inputs(0, torch.float32, bias=False)
    FusedLinearCrossEntropy(backend="torch")(h, w, labels)
    assert seen[-1][0] == CPU and not plan_chunks(*seen[-1]).fast
    assert plan_chunks(CUDA, *seen[-1][1:]).fast


@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_fast_path_matches_float64_reference(eager_chunk_math, softcap, bias, reduction, dtype, tol) -> None:
    h, w, b, labels = _inputs(hash((softcap, bias, reduction)) % 1000, dtype, bias)
    fused = FusedLinearCrossEntropy(reduction=reduction, logit_softcap=softcap, chunk_size=8, compile=True)
    (loss, grads), (ref, ref_grads) = _run(fused, h, w, b, labels, softcap, reduction)
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        assert (grad is None) == (ref_grad is None)
        if grad is not None:
            assert grad.dtype == dtype and _rel_err(grad, ref_grad) <= tol


# bf16: the logit gradient is rounded to bf16 (the matmuls' input anyway) and the weight gradient is accumulated in
# bf16 once per token chunk (cuBLAS/CPU addmm sums each chunk's product in fp32). With 8 chunks here that costs up to
# 2x the plain bf16 loss's own error on the weight gradient; hidden states and the loss stay as accurate as plain.
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_fast_path_bf16_accuracy_against_the_plain_bf16_loss(eager_chunk_math, softcap) -> None:
    h, w, b, labels = _inputs(7, torch.bfloat16, bias=True)
    fused = FusedLinearCrossEntropy(logit_softcap=softcap, chunk_size=8, compile=True)
    (loss, grads), (ref, ref_grads) = _run(fused, h, w, b, labels, softcap)

    plain_loss, plain_grads = loss_and_grads(plain_head_loss(labels, softcap), [h, w, b])
    assert abs(loss.item() - ref.item()) <= 1.5 * abs(plain_loss.item() - ref.item()) + 5e-4
    for name, grad, plain_grad, ref_grad in zip(("hidden", "weight", "bias"), grads, plain_grads, ref_grads,
                                                strict=True):
        factor = 2.0 if name == "weight" else 1.5
        assert grad.dtype == torch.bfloat16
        assert _rel_err(grad, ref_grad) <= min(1e-2, factor * _rel_err(plain_grad, ref_grad) + 5e-4), name


def test_fast_path_flops_are_the_three_matmuls_and_nothing_more(eager_chunk_math) -> None:
    batch, seq, hidden, vocab = 2, 512, 16, 2048
    h, w, _, labels = _inputs(3, torch.float32, bias=False, shape=(batch, seq, hidden, vocab))
    labels[:, :64] = -100
    label_tokens = int((labels[:, 1:] != -100).sum())
    per_token = 2 * vocab * hidden  # one matmul's FLOPs per label token
    fused = FusedLinearCrossEntropy(chunk_size=128, compile=True)
    h.requires_grad_(), w.requires_grad_()
    with FlopCounterMode(display=False) as counter:
        fused(h, w, labels).backward()
    assert counter.get_total_flops() == 3 * per_token * label_tokens  # forward logits, d_hidden, d_weight
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fused(h, w, labels)
    assert counter.get_total_flops() == per_token * label_tokens


def test_a_failed_compile_warns_once_and_the_math_runs_eagerly(monkeypatch, caplog) -> None:
    def broken(fn):
        def run(*args):
            raise RuntimeError("Cannot find a working triton installation\nmore detail")
        return run

    math = CompiledChunkMath(compiler=broken)
    monkeypatch.setattr(chunked, "CHUNK_MATH", math)
    h, w, b, labels = _inputs(5, torch.float64, bias=True)
    with caplog.at_level(logging.WARNING, logger="remat.loss"):
        (loss, grads), (ref, ref_grads) = _run(FusedLinearCrossEntropy(chunk_size=16, compile=True), h, w, b, labels)
        FusedLinearCrossEntropy(chunk_size=16, compile=True)(h.detach(), w.detach(), labels)
    assert math.failed == "RuntimeError: Cannot find a working triton installation"
    assert [r.getMessage() for r in caplog.records if "torch.compile of the chunk math failed" in r.getMessage()]
    assert len(caplog.records) == 1
    assert abs(loss.item() - ref.item()) <= 1e-12 * ref.item()
    assert all(_rel_err(g, r) <= 1e-12 for g, r in zip(grads, ref_grads, strict=True))


def test_chunk_math_writes_the_gradient_over_the_logits_buffer() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=generator, dtype=torch.float64)
    targets = torch.tensor([0, 3, 10, 4, 4])
    original = logits.clone().requires_grad_()
    lse, loss = softmax_xent_grad_(logits, targets, torch.tensor(0.5, dtype=torch.float64), softcap=None)
    expected = F.cross_entropy(original, targets, reduction="none")
    (expected.sum() * 0.5).backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(original.detach(), 1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(logits, original.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_compiled_on_the_cpu_equals_the_eager_math_and_does_not_recompile_for_a_new_scale(tmp_path,
                                                                                        monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    math = CompiledChunkMath()
    monkeypatch.setattr(chunked, "CHUNK_MATH", math)
    h, w, b, labels = _inputs(11, torch.float32, bias=True, shape=(2, 40, 16, 300))
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    results, compiled_graphs = [], []
    for divisor in (None, 50):  # two different scales: the scale is a tensor, no recompile
        fused = FusedLinearCrossEntropy(chunk_size=32, compile=True, logit_softcap=4.0)
        results.append(_run(lambda *a, **k: fused(*a, **k, num_label_tokens=divisor), h, w, b, labels, 4.0))
        compiled_graphs.append(graphs["unique_graphs"])
    assert math.failed is None
    assert compiled_graphs[0] >= 1 and compiled_graphs[1] == compiled_graphs[0]
    (loss, grads), (ref, ref_grads) = results[0]
    assert abs(loss.item() - ref.item()) <= 2e-6 * ref.item()
    assert all(_rel_err(g, r) <= 2e-6 for g, r in zip(grads, ref_grads, strict=True))
    assert compiled.compile_available(CPU)


@pytest.mark.slow
def test_a_training_run_whose_label_count_changes_every_step_compiles_twice_and_never_again(tmp_path,
                                                                                           monkeypatch) -> None:
    """Packed rows give each step another number of label tokens, so the last chunk's shape changes every step: the
    compiled chunk math compiles for the first shape and again with that size dynamic, then never again (no
    recompile per step): 2 graphs on torch 2.13, in 6 steps."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    math = CompiledChunkMath()
    monkeypatch.setattr(chunked, "CHUNK_MATH", math)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    torch.manual_seed(0)
    weight = torch.randn(300, 16, requires_grad=True)
    fused = FusedLinearCrossEntropy(chunk_size=32, compile=True)
    graphs = []
    before = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())  # counters outlive reset()
    for step in range(6):
        hidden = torch.randn(2, 40, 16, requires_grad=True)
        labels = torch.randint(0, 300, (2, 40))
        labels[:, : 3 + 2 * step] = -100  # another label count each step
        fused(hidden, weight, labels).backward()
        graphs.append(counters["stats"]["unique_graphs"] - before[0])
    assert math.failed is None
    # the first shape, then the size made dynamic (torch versions differ by one compile at most); then none
    assert graphs[2] <= 3 and graphs[-1] == graphs[2], graphs
    assert sum(counters["recompiles"].values()) - before[1] <= 2, dict(counters["recompiles"])


def test_under_fake_tensors_the_fast_path_allocates_like_the_kernel_and_never_compiles(monkeypatch) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def must_not_compile(fn):
        raise AssertionError("compiled under FakeTensorMode")

    math = CompiledChunkMath(compiler=must_not_compile)
    monkeypatch.setattr(chunked, "CHUNK_MATH", math)
    settings = chunked.ChunkSettings(scale=0.01, softcap=None, token_chunk=32, strategy="forward", fast=True)
    with FakeTensorMode():  # how remat.estimate_memory simulates a step (it selects the label rows for real)
        logits = torch.randn(64, 300, dtype=torch.bfloat16)
        lse, loss = math(logits, torch.zeros(64, dtype=torch.long), torch.tensor(1.0), None)
        assert lse.shape == loss.shape == (64,) and lse.dtype == torch.float32
        h = torch.randn(128, 16, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(300, 16, dtype=torch.bfloat16, requires_grad=True)
        targets, rows = torch.zeros(128, dtype=torch.long), torch.arange(100)
        chunked.ChunkedLinearCrossEntropy.apply(h, w, None, targets, rows, settings).backward()
        assert w.grad.shape == w.shape and w.grad.dtype == torch.bfloat16
    assert math.failed is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the fast path's default home)")
def test_on_cuda_the_compiled_fast_path_is_exact_and_holds_the_gradients_plus_one_chunk() -> None:
    vocab, hidden, tokens = 32000, 256, 4096
    h, w, _, labels = _inputs(13, torch.bfloat16, bias=False, shape=(2, tokens // 2, hidden, vocab))
    h, w, labels = h.cuda().requires_grad_(), w.cuda().requires_grad_(), labels.cuda()
    fused = FusedLinearCrossEntropy(backend="torch", chunk_size=1024)
    assert plan_chunks(h.device, w, tokens, None, "auto", None, 1024, None).fast
    fused(h, w, labels).backward()  # compiles
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = fused(h, w, labels)
    loss.backward()
    working = torch.cuda.max_memory_allocated() - before
    assert chunked.CHUNK_MATH.failed is None
    gradients = h.numel() * 2 + w.numel() * 2
    assert working <= 1.1 * (gradients + 1024 * vocab * 2) + 2**20  # no fp32 [rows, vocab] temporary
    ref = reference_loss(h.detach().cpu(), w.detach().cpu(), labels.cpu())
    assert abs(loss.item() - ref.item()) <= 1e-2 * ref.item()
