"""Activation offloading, exercised on the CPU with `copy_cpu_tensors=True`: what moves, when it comes back, what
is released, and that gradients are unchanged (alone, and around non-reentrant checkpointing)."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from test_selective import checkpoint_layers, llama_step, tiny_llama  # the tiny HF Llama helpers, shared

from remat.checkpointing.offload import OffloadActivations
from remat.checkpointing.selective import selective_context_fn
from remat.errors import ConfigError

KIB = 1024
ROWS, DIM = 32, 64
ACT_BYTES = ROWS * DIM * 4  # one [32, 64] float32 activation: 8 KiB


def offload(**kwargs: Any) -> OffloadActivations:
    return OffloadActivations(min_bytes=KIB, copy_cpu_tensors=True, **kwargs)


class Chain(nn.Module):
    """Three tanh(x @ W) stages; each saves its matmul input and its tanh output."""

    def __init__(self, stages: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(DIM, DIM) / 8) for _ in range(stages))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.tanh(x @ w)
        return x


def grads_of(model: nn.Module, run: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    run().square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def assert_equal_grads(expected: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(expected) == len(got)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_offload_alone_gradients_stats_and_dedup() -> None:
    model = Chain()
    x = torch.randn(ROWS, DIM) * 2  # not a leaf that requires grad: a real activation
    expected = grads_of(model, lambda: model(x))
    off = offload(prefetch=0)

    def run() -> torch.Tensor:
        with off:
            y = model(x)
        # Saved: x, h1 (tanh out, then mm input: one copy), h2 (same), h3 (tanh out); weights are parameters.
        assert (off.stats.offloaded_tensors, off.stats.offloaded_bytes) == (4, 4 * ACT_BYTES)
        assert off.stats.deduplicated == 2
        assert off.stats.skipped == {"parameter": 2}  # mm saves W only when its input needs a grad: stages 2, 3
        assert off.stats.restored_tensors == 0  # nothing comes back before backward
        return y

    assert_equal_grads(expected, grads_of(model, run))
    assert (off.stats.restored_tensors, off.stats.restored_bytes) == (4, 4 * ACT_BYTES)  # each copy once
    assert off.stats.prefetched == 0


def _snapshot(seen: list[tuple[str, int]], label: str, off: OffloadActivations) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        seen.append((label, off.stats.restored_tensors))

    return hook


def test_restored_in_reverse_order_as_backward_asks_for_them() -> None:
    model = Chain()
    x = torch.randn(ROWS, DIM) * 2
    seen: list[tuple[str, int]] = []
    for prefetch in (0, 1):
        off = offload(prefetch=prefetch)
        with off:
            h, outs = x, []
            for w in model.weights:
                h = torch.tanh(h @ w)
                outs.append(h)
        for i, out in enumerate(outs):  # runs when backward reaches `out`, before its tanh backward unpacks it
            out.register_hook(_snapshot(seen, f"p{prefetch} stage{i + 1}", off))
        h.sum().backward()
    # Saved in order: x (mm1), h1 (tanh1, mm2), h2 (tanh2, mm3), h3 (tanh3). Backward unpacks h3, h2, h2, h1, h1, x.
    assert seen == [
        # prefetch=0: each stage's copies come back only when its own backward asks for them
        ("p0 stage3", 0), ("p0 stage2", 2), ("p0 stage1", 3),
        # prefetch=1: restoring a copy also restores the one saved just before it
        ("p1 stage3", 0), ("p1 stage2", 3), ("p1 stage1", 4),
    ]


def test_original_storage_is_released_and_host_copies_die_after_backward() -> None:
    model = Chain()
    x = torch.randn(ROWS, DIM) * 2
    device_refs: list[weakref.ref[torch.UntypedStorage]] = []

    def forward(off: OffloadActivations | None) -> torch.Tensor:
        h = x
        with off if off is not None else contextlib.nullcontext():
            for w in model.weights:
                h = torch.tanh(h @ w)
                device_refs.append(weakref.ref(h.untyped_storage()))
        return h.sum()

    loss = forward(None)
    assert all(ref() is not None for ref in device_refs)  # autograd holds the saved activations
    loss.backward()
    device_refs.clear()

    off = offload(prefetch=2)
    loss = forward(off)
    assert all(ref() is None for ref in device_refs)  # only the host copies hold the saved activations now
    host_refs = [ref for _, ref in off._order]
    assert len(host_refs) == 4 and all(ref() is not None for ref in host_refs)
    assert off.host_bytes == 4 * ACT_BYTES
    loss.backward()
    assert all(ref() is None for ref in host_refs)  # no cycles: freed by reference counting, without gc
    assert off.host_bytes == 0 and off._outstanding == set()
    with off:  # entering again drops the dead bookkeeping
        pass
    assert off._order == [] and len(off._by_storage) == 0


def test_small_tensors_parameters_views_of_parameters_and_buffers_stay() -> None:
    lin = nn.Linear(DIM, DIM, bias=False)
    lin.register_buffer("mask", torch.ones(ROWS, DIM))
    x = torch.randn(ROWS, DIM, requires_grad=True) * 2
    big_leaf = torch.randn(ROWS, DIM, requires_grad=True)
    tiny = torch.randn(4, 4, requires_grad=True) * 2

    off = offload(module=lin)
    with off:
        a = lin(big_leaf)  # mm saves the leaf input (held by its owner) and W.t() (a view of a parameter)
        b = (a * lin.mask).sin()  # mul saves the module's buffer; sin saves a * mask, an activation
        c = (tiny * tiny.sum()).sum()  # mul saves a 64-byte and a 4-byte tensor
        d = x.sin().sum()  # saves x, an activation
    assert off.stats.skipped == {"parameter": 3, "small": 2}
    assert (off.stats.offloaded_tensors, off.stats.offloaded_bytes) == (2, 2 * ACT_BYTES)
    (b.sum() + c + d).backward()
    assert off.stats.restored_tensors == 2
    assert lin.weight.grad is not None and big_leaf.grad is not None

    cpu_default = OffloadActivations(min_bytes=0)
    with cpu_default:
        (x * x).sum()
    assert cpu_default.stats.skipped == {"host": 2} and cpu_default.stats.offloaded_tensors == 0


def test_unpack_restores_values_and_survives_in_place_edits_after_saving() -> None:
    off = offload()
    x = torch.randn(ROWS, DIM, requires_grad=True)
    with off:
        h = x * 3
        y = h.sin()  # saves h
    expected = torch.cos(h.detach()) * 3
    restored = off._unpack(off._order[0][1]())
    assert restored.data_ptr() != h.data_ptr()
    torch.testing.assert_close(restored, h.detach(), rtol=0, atol=0)
    y.sum().backward()
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_restored_tensors_keep_their_strides_when_dense() -> None:
    off = offload(prefetch=0)
    base = torch.randn(DIM, ROWS, requires_grad=True) * 2
    with off:
        transposed = base.t()  # dense, permuted strides
        expanded = base[:1].expand(ROWS, DIM, ROWS)  # overlapping: restored contiguous
        y = transposed.sin()
        z = expanded.sin()
    copies = [ref() for _, ref in off._order]
    assert [c.host.stride() for c in copies] == [(1, ROWS), (ROWS * DIM, ROWS, 1)]
    restored = [off._unpack(c) for c in copies]
    assert restored[0].stride() == transposed.stride()
    torch.testing.assert_close(restored[0], transposed.detach(), rtol=0, atol=0)
    torch.testing.assert_close(restored[1], expanded.detach(), rtol=0, atol=0)
    del y, z


def _two_layer_block(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(torch.tanh(t @ w) @ w.t())


def _checkpoint_placeholder_saves() -> int:
    """Empty tensors one non-reentrant checkpoint call saves through the outer saved-tensor hooks along with its
    inputs: torch 2.11's ``_NoopSaveInputs`` saves a 0-element dummy next to them (1), newer torch saves none (0)."""
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        checkpoint(torch.tanh, torch.ones(2, requires_grad=True), use_reentrant=False)
    return sum(t.numel() == 0 for t in saved)


def test_offload_around_full_checkpoint_moves_only_block_inputs() -> None:
    model = Chain(stages=4)
    x = torch.randn(ROWS, DIM) * 2

    def plain() -> torch.Tensor:
        h = x * 1.0
        for w in model.weights:
            h = _two_layer_block(h, w)
        return h

    expected = grads_of(model, plain)
    off = offload()
    input_refs: list[weakref.ref[torch.UntypedStorage]] = []

    def run() -> torch.Tensor:
        h = x * 1.0
        for w in model.weights:
            input_refs.append(weakref.ref(h.untyped_storage()))
            with off:
                h = checkpoint(_two_layer_block, h, w, use_reentrant=False)
        # Checkpoint saved its positional inputs through our hooks: four block inputs went to the host, the four
        # weights stayed; nothing inside the regions reached us (recomputed in backward). Where checkpoint also saves
        # an empty placeholder per call, that one is left alone as "small" (nothing to move).
        skipped = Counter(parameter=4, small=4 * _checkpoint_placeholder_saves())
        assert (off.stats.offloaded_tensors, +off.stats.skipped) == (4, +skipped)
        assert all(ref() is None for ref in input_refs)  # each block input now lives only in its host copy
        return h

    assert_equal_grads(expected, grads_of(model, run))
    assert off.stats.restored_tensors == 4


@pytest.mark.parametrize("context", ["selective", "full"])
def test_offload_with_checkpoint_on_llama_gradients_equal(context: str) -> None:

    model = tiny_llama(attention_dropout=0.1)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    expected = llama_step(model, ids)
    off = offload()
    checkpoint_layers(model, selective_context_fn() if context == "selective" else None, outer=off)
    got = llama_step(model, ids)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)
    assert off.stats.offloaded_tensors == 2  # the hidden states entering each of the two layers
    assert off.stats.offloaded_bytes == 2 * 2 * 16 * 32 * 4
    assert off.stats.restored_tensors == 2


def test_offload_policy_alone_on_llama_layers() -> None:

    model = tiny_llama(attention_dropout=0.1)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    expected = llama_step(model, ids)
    off = offload(module=model)
    for layer in model.model.layers:
        inner = layer.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            with off:
                return _inner(*args, **kwargs)

        layer.forward = forward
    got = llama_step(model, ids)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)
    assert off.stats.offloaded_tensors > 10 and off.stats.skipped["parameter"] > 0
    assert off.stats.restored_tensors == off.stats.offloaded_tensors


def test_inside_a_checkpointed_region_it_steps_aside_with_a_warning() -> None:
    model = Chain()
    x = torch.randn(ROWS, DIM) * 2
    expected = grads_of(model, lambda: model(x))
    off = offload()

    def inner(t: torch.Tensor) -> torch.Tensor:
        with off:
            return model(t)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = grads_of(model, lambda: checkpoint(inner, x, use_reentrant=False))
    assert_equal_grads(expected, got)
    assert off.stats.offloaded_tensors == 0
    assert len([w for w in caught if "inside a non-reentrant checkpointed region" in str(w.message)]) == 1


def test_bad_arguments_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"min_bytes=\.\.\.\) got -1; allowed: an integer >= 0"):
        OffloadActivations(min_bytes=-1)
    with pytest.raises(ConfigError, match=r"prefetch=\.\.\.\) got 1.5"):
        OffloadActivations(prefetch=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"pin_memory=\.\.\.\) got 'yes'; allowed: True or False"):
        OffloadActivations(pin_memory="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"module=\.\.\.\) got Tensor"):
        OffloadActivations(module=torch.zeros(1))  # type: ignore[arg-type]
