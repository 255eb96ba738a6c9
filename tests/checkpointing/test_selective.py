"""Selective (op-level) checkpointing: exact gradients, the decision table, the matmul alternation and the trace."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from remat.checkpointing.selective import (
    ALTERNATE_OPS,
    POLICY_SEES_OUTPUT,
    SAVE_OPS,
    TRACE_ENV_VAR,
    Decision,
    SelectivePolicy,
    mutation_safe_contexts,
    reset_selective_trace,
    selective_context_fn,
    selective_trace_summary,
)
from remat.errors import ConfigError

aten = torch.ops.aten
LOGGER = "remat.checkpointing.selective"


@pytest.fixture(autouse=True)
def _fresh_trace(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(TRACE_ENV_VAR, raising=False)
    reset_selective_trace()
    yield
    reset_selective_trace()


# ---------------------------------------------------------------------------------------------------- helpers
def tiny_llama(*, attn_implementation: str = "sdpa", attention_dropout: float = 0.0, layers: int = 2) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        attention_dropout=attention_dropout,
        attn_implementation=attn_implementation,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def checkpoint_layers(
    model: nn.Module, context_fn: Callable[[], Any] | None, outer: AbstractContextManager[Any] | None = None
) -> None:
    """Wrap each decoder layer's forward in non-reentrant checkpoint (context_fn=None: full checkpointing),
    called inside `outer` when given (e.g. an OffloadActivations, which then offloads the layer inputs)."""
    extra = {} if context_fn is None else {"context_fn": context_fn}
    for layer in model.model.layers:  # type: ignore[union-attr]
        inner = layer.forward

        def forward(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            with outer if outer is not None else nullcontext():
                return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

        layer.forward = forward


def llama_step(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == got.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


class Block(nn.Module):
    """A pre-norm transformer block written by hand: SDPA attention and a SiLU MLP, dropout everywhere."""

    def __init__(self, dim: int = 16, heads: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, dropout_p=self.dropout if self.training else 0.0,
        )
        x = x + F.dropout(self.proj(attn.transpose(1, 2).reshape(b, s, d)), self.dropout, self.training)
        return x + F.dropout(self.down(F.silu(self.up(self.norm2(x)))), self.dropout, self.training)


def block_grads(blocks: nn.ModuleList, x: torch.Tensor, context_fn: Callable[[], Any] | None) -> list[torch.Tensor]:
    torch.manual_seed(99)
    blocks.zero_grad(set_to_none=True)
    h = x
    for block in blocks:
        h = block(h) if context_fn is None else checkpoint(block, h, use_reentrant=False, context_fn=context_fn)
    h.square().mean().backward()
    return [p.grad.clone() for p in blocks.parameters()]


# ---------------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize(
    ("attn_implementation", "attention_dropout"), [("sdpa", 0.0), ("sdpa", 0.1), ("eager", 0.1)]
)
def test_llama_gradients_equal_no_checkpointing(attn_implementation: str, attention_dropout: float) -> None:
    model = tiny_llama(attn_implementation=attn_implementation, attention_dropout=attention_dropout)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    expected = llama_step(model, ids)
    checkpoint_layers(model, selective_context_fn())
    assert_same_grads(expected, llama_step(model, ids))


@pytest.mark.parametrize("save_every_other_mm", [True, False])
def test_hand_written_block_with_dropout_gradients_equal(save_every_other_mm: bool) -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(3))
    x = torch.randn(2, 8, 16, requires_grad=True)
    expected = block_grads(blocks, x, None)
    got = block_grads(blocks, x, selective_context_fn(save_every_other_mm=save_every_other_mm))
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def _rand_dropout(h: torch.Tensor) -> torch.Tensor:
    return h * (torch.rand_like(h) > 0.5) * 2.0


def test_random_ops_are_recomputed_so_later_masks_match() -> None:
    """Caching one random op and recomputing a later one shifts the RNG stream: the policy must not do that."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return _rand_dropout(_rand_dropout(x @ w1) @ w2).sum()

    def run(context_fn: Callable[[], Any] | None) -> torch.Tensor:
        w1.grad = None
        torch.manual_seed(7)
        (fn(x) if context_fn is None else checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)).backward()
        return w1.grad.clone()

    def save_first_random_op() -> Any:
        calls = {False: 0, True: 0}  # per mode: torch 2.11 asks again in the recompute, 2.13+ replays the forward

        def policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if op is aten.rand_like.default:
                calls[ctx.is_recompute] += 1
                if calls[ctx.is_recompute] == 1:
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    expected = run(None)
    assert not torch.equal(run(save_first_random_op), expected)  # the hazard is real
    torch.testing.assert_close(run(selective_context_fn()), expected, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------- decisions
def _decide(op: Any, *args: Any, out: Any = None, **kwargs: Any) -> tuple[Decision, bool]:
    decision, saved, _ = SelectivePolicy().decide(op, args, kwargs, out)
    return decision, saved


def test_attention_kernels_saved_unless_they_draw_dropout() -> None:
    q = torch.randn(1, 2, 4, 8)
    assert _decide(aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q) == (Decision.SAVE, True)
    assert _decide(aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q, 0.0, True) == (
        Decision.SAVE, True,
    )
    assert _decide(aten._scaled_dot_product_flash_attention_for_cpu.default, q, q, q, 0.1) == (
        Decision.RECOMPUTE, False,
    )
    assert _decide(aten._scaled_dot_product_efficient_attention.default, q, q, q, None, False, dropout_p=0.2) == (
        Decision.RECOMPUTE, False,
    )
    for name in SAVE_OPS:
        if name.startswith("aten._scaled_dot_product") or name.startswith("aten._flash") or "efficient" in name:
            packet, overload = name.removeprefix("aten.").rsplit(".", 1)
            op = getattr(getattr(aten, packet), overload)
            assert _decide(op, q, q, q)[0] is Decision.SAVE, name


def test_router_topk_collectives_and_random_ops() -> None:
    import torch.distributed._functional_collectives  # noqa: F401  (registers the _c10d_functional ops)

    x = torch.randn(4, 8)
    assert _decide(aten.topk.default, x, 2) == (Decision.SAVE, True)
    for op in (
        torch.ops._c10d_functional.all_reduce.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional.wait_tensor.default,
    ):
        assert _decide(op, x) == (Decision.SAVE, True), op
    for op in (aten.native_dropout.default, aten.bernoulli_.float, aten.rand_like.default):
        assert _decide(op, x, 0.5) == (Decision.RECOMPUTE, False), op
    for op in (aten.silu.default, aten.mul.Tensor, aten.add.Tensor, aten._softmax.default):
        assert _decide(op, x) == (Decision.RECOMPUTE, False), op


def test_device_to_host_copies_saved_only_when_leaving_the_accelerator() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on_device = torch.empty(4, 8, device="cuda")
        on_host = torch.empty(4, 8)
        to_host = on_device.cpu()
        assert _decide(aten._to_copy.default, on_device, out=to_host) == (Decision.SAVE, True)
        assert _decide(aten._to_copy.default, on_host, out=on_device) == (Decision.RECOMPUTE, False)
        assert _decide(aten._to_copy.default, on_device, out=on_device.half()) == (Decision.RECOMPUTE, False)
        assert _decide(aten._to_copy.default, on_host, out=on_host.half()) == (Decision.RECOMPUTE, False)
        assert _decide(aten._local_scalar_dense.default, on_device, out=1.0) == (Decision.SAVE, True)
        assert _decide(aten.nonzero.default, on_host, out=on_host) == (Decision.RECOMPUTE, False)


def test_every_other_matmul_saved_and_recompute_counts_separately() -> None:
    policy = SelectivePolicy()
    x = torch.randn(2, 2)
    ops = [aten.mm.default, aten.silu.default, aten.addmm.default, aten.bmm.default, aten.mm.default, aten.mm.default]

    def decisions(is_recompute: bool) -> list[CheckpointPolicy]:
        # torch 2.13+ passes the output; torch 2.11 asks before the op runs
        ctx = SelectiveCheckpointContext(is_recompute=is_recompute, **({"op_output": x} if POLICY_SEES_OUTPUT else {}))
        return [policy(ctx, op, x, x) for op in ops]

    forward = decisions(False)
    save, recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert forward == [save, recompute, recompute, save, recompute, save]
    assert decisions(True) == forward  # the recompute's n-th matmul gets the forward's n-th answer

    every = SelectivePolicy(save_every_other_mm=False)
    assert all(every(SelectiveCheckpointContext(is_recompute=False), aten.mm.default, x, x) is save for _ in range(3))
    assert set(ALTERNATE_OPS) >= {"aten.mm.default", "aten.bmm.default", "aten.addmm.default"}


@pytest.mark.parametrize("n_matmuls", [1, 4, 5])
def test_saved_matmul_outputs_are_ceil_half_and_backward_matches(n_matmuls: int) -> None:
    torch.manual_seed(0)
    weights = [torch.randn(16, 16, requires_grad=True) for _ in range(n_matmuls)]
    x = torch.randn(8, 16, requires_grad=True)

    def fn(h: torch.Tensor) -> torch.Tensor:
        for w in weights:
            h = torch.tanh(h @ w)
        return h

    fn(x).sum().backward()
    expected = [w.grad.clone() for w in weights]
    for w in weights:
        w.grad = None
    checkpoint(fn, x, use_reentrant=False, context_fn=selective_context_fn(trace=True)).sum().backward()
    for e, w in zip(expected, weights, strict=True):
        torch.testing.assert_close(w.grad, e, rtol=0, atol=0)
    (mm,) = [r for r in selective_trace_summary() if r.op == "aten.mm.default"]
    assert (mm.decision, mm.calls, mm.saved) == (Decision.ALTERNATE, n_matmuls, math.ceil(n_matmuls / 2))


def test_saved_matmuls_are_exactly_the_extra_bytes_held() -> None:
    from remat.memory import LiveTensorTracker

    torch.manual_seed(0)
    weights = [torch.randn(16, 32, 32, requires_grad=True) for _ in range(5)]
    x = torch.randn(16, 8, 32, requires_grad=True)
    out_bytes = 16 * 8 * 32 * 4

    def fn(h: torch.Tensor) -> torch.Tensor:
        for w in weights:
            h = torch.bmm(h, w).relu()
        return h.sin()

    held = {}
    for name, context_fn in (("full", None), ("selective", selective_context_fn())):
        kwargs = {} if context_fn is None else {"context_fn": context_fn}
        with LiveTensorTracker() as tracker:
            y = checkpoint(fn, x, use_reentrant=False, **kwargs)
            held[name] = tracker.current_bytes
        y.sum().backward()
    assert held["full"] == out_bytes  # only the output: the input was created outside the tracker
    assert held["selective"] - held["full"] == 3 * out_bytes  # bmm outputs 1, 3 and 5 of 5


def test_selective_holds_between_full_and_none_on_llama() -> None:
    from remat.memory import LiveTensorTracker

    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(3))
    held = {}
    for policy in ("none", "selective", "full"):
        model = tiny_llama(layers=3)
        if policy != "none":
            checkpoint_layers(model, selective_context_fn() if policy == "selective" else None)
        with LiveTensorTracker(module=model) as tracker:
            loss = model(input_ids=ids, labels=ids).loss
            tracker.mark("after_forward")
            loss.backward()
        held[policy] = tracker.marks["after_forward"]
    assert held["none"] > held["selective"] > held["full"]


# ---------------------------------------------------------------------------------------------------- trace
def test_trace_via_env_logs_each_unique_op_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(TRACE_ENV_VAR, "1")
    model = tiny_llama()
    checkpoint_layers(model, selective_context_fn())
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        llama_step(model, ids)
        llama_step(model, ids)
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert (
        "SAVE      aten._scaled_dot_product_flash_attention_for_cpu.default  out [2, 4, 8, 8] float32, [2, 4, 8] "
        "float32 2.2 KiB  (attention kernel: O(seq^2) FLOPs for an O(seq*dim) output (SDPA on the CPU))"
    ) in lines
    assert "ALTERNATE aten.mm.default  out [16, 32] float32 2.0 KiB  (dense matmul (linear layers))" in lines
    assert "RECOMPUTE aten.silu.default  out [2, 8, 64] float32 4.0 KiB" in lines
    for op in ("aten.mul.Tensor", "aten.add.Tensor"):
        assert any(line.startswith(f"RECOMPUTE {op}  out ") for line in lines), op
    assert len(lines) == len(set(lines))  # two steps, four layer calls: each unique op is logged once

    summary = {r.op: r for r in selective_trace_summary()}
    mm = summary["aten.mm.default"]
    assert (mm.calls, mm.saved) == (2 * 2 * 7, 2 * 2 * 4)  # 2 steps x 2 layers x 7 linears, 4 of 7 saved
    assert summary["aten.silu.default"].saved == 0

    reset_selective_trace()
    assert selective_trace_summary() == []


def test_trace_off_by_default_and_forced_by_argument(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        checkpoint(lambda h: (h @ w).relu(), x, use_reentrant=False, context_fn=selective_context_fn()).sum()
        assert caplog.records == [] and selective_trace_summary() == []
        monkeypatch.setenv(TRACE_ENV_VAR, "1")
        checkpoint(lambda h: (h @ w).relu(), x, use_reentrant=False, context_fn=selective_context_fn(trace=False))
        assert caplog.records == []
        monkeypatch.delenv(TRACE_ENV_VAR)
        checkpoint(lambda h: (h @ w).relu(), x, use_reentrant=False, context_fn=selective_context_fn(trace=True))
    assert [r.getMessage().split()[:2] for r in caplog.records] == [
        ["ALTERNATE", "aten.mm.default"],
        ["RECOMPUTE", "aten.relu.default"],
    ]


def test_bad_env_value_and_bad_arguments_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACE_ENV_VAR, "maybe")
    context_fn = selective_context_fn()
    with pytest.raises(ConfigError, match=r"REMAT_SELECTIVE_AC_TRACE='maybe'.*allowed: 1/true"):
        context_fn()
    with pytest.raises(ConfigError, match=r"trace=\.\.\.\) got 'yes'"):
        selective_context_fn(trace="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"save_every_other_mm=\.\.\.\) got 2"):
        selective_context_fn(save_every_other_mm=2)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- in-place writes
# Torch's selective-checkpoint cache replays saved outputs by call index; an output written in place after it was
# saved must be recomputed instead (remat.checkpointing.selective.mutation_safe_contexts).
def _unguarded_selective() -> Any:
    """Torch's own contexts with remat's policy and no mutation guard: what remat did before the guard."""
    return create_selective_checkpoint_contexts(SelectivePolicy())


def _grads(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], context_fn: Any) -> list[torch.Tensor]:
    """Gradients of fn(*inputs).sum() wrt inputs: context_fn=None runs fn without checkpointing, "full" under full
    checkpointing, anything else is a selective context_fn."""
    for t in inputs:
        t.grad = None
    if context_fn is None:
        out = fn(*inputs)
    elif context_fn == "full":
        out = checkpoint(fn, *inputs, use_reentrant=False)
    else:
        out = checkpoint(fn, *inputs, use_reentrant=False, context_fn=context_fn)
    out.sum().backward()
    return [t.grad.clone() for t in inputs]


def _assert_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


class MutatingBlock(nn.Module):
    """A block that writes into matmul outputs the selective policy saves: the first through the output itself
    (its version counter moves; torch would raise), the second through ``torch.matmul``'s ``_unsafe_view`` of a bmm
    (its own version counter: torch sees nothing), as gemma3n's AltUp does."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.mix = nn.Parameter(torch.randn(3, dim, dim) / dim**0.5)
        self.down = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [3, tokens, dim]
        h = x.reshape(-1, x.shape[-1]).mm(self.up)  # mm 1: saved
        h.mul_(0.5)  # written in place through the saved tensor itself
        h = torch.tanh(h).reshape(x.shape)
        p = torch.matmul(h, self.mix)  # bmm 2 (recomputed) ... matmul's 3-D path: _unsafe_view(bmm out)
        p = torch.tanh(p)
        q = torch.matmul(p, self.mix)  # bmm 3: saved, returned as an _unsafe_view
        q += x  # written through the alias, which does not share the bmm output's version counter
        return torch.sin(q).reshape(-1, x.shape[-1]).mm(self.down)


def test_outputs_written_in_place_are_recomputed_and_gradients_match(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    block = MutatingBlock()
    x = torch.randn(3, 5, 8, requires_grad=True)
    inputs = [x, *block.parameters()]
    expected = _grads(lambda x, *_: block(x), inputs, None)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        got = _grads(lambda x, *_: block(x), inputs, selective_context_fn(trace=True))
    _assert_equal(got, expected)
    downgrades = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DOWNGRADE")]
    assert downgrades == [
        "DOWNGRADE aten.mm.default  saved output later written in place (by aten.mul_.Tensor in the forward): "
        "recomputed in backward instead",
        "DOWNGRADE aten.bmm.default  saved output later written in place (by aten.add_.Tensor in the forward): "
        "recomputed in backward instead",
    ]
    summary = {r.op: r for r in selective_trace_summary()}
    assert (summary["aten.mm.default"].saved, summary["aten.mm.default"].downgraded) == (1, 1)  # the last mm: not saved
    assert (summary["aten.bmm.default"].saved, summary["aten.bmm.default"].downgraded) == (1, 1)

    # Without the guard, torch raises for the first write and would return the second silently mutated.
    with pytest.raises(RuntimeError, match="cached during selective activation checkpoint has been mutated"):
        _grads(lambda x, *_: block(x), inputs, _unguarded_selective)


def test_unsafe_view_write_is_silent_without_the_guard() -> None:
    """gemma3n's AltUp.predict in miniature: the hazard is real, and torch does not notice it."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 3, 4, 5, requires_grad=True)  # [altup inputs, batch, tokens, dim]
    coefs = torch.randn(3, 4, 2, 2, requires_grad=True)

    def predict(hidden: torch.Tensor, coefs: torch.Tensor) -> torch.Tensor:
        predictions = torch.matmul(hidden.permute(1, 2, 3, 0), coefs).permute(3, 0, 1, 2)
        predictions += hidden
        return predictions.contiguous().sin()

    expected = _grads(predict, [hidden, coefs], None)
    assert any(not torch.equal(g, e) for g, e in zip(_grads(predict, [hidden, coefs], _unguarded_selective), expected))
    _assert_equal(_grads(predict, [hidden, coefs], selective_context_fn()), expected)


@pytest.mark.parametrize("through_alias", [False, True])
def test_write_after_the_region_is_caught_before_recompute(through_alias: bool) -> None:
    """The caller writes into a returned saved output after the region: the entry is recomputed in backward.

    Without checkpointing autograd refuses this (sin saved the tensor); full checkpointing recomputes it exactly,
    and so must selective."""
    torch.manual_seed(0)
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(2, 4, 6, requires_grad=True)

    def region(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # 3-D @ 2-D: matmul returns _unsafe_view(mm out), an alias with its own version counter; mm's own output
        # (a 2-D product) is the saved tensor itself.
        y = torch.matmul(x, w) if through_alias else x.reshape(-1, 6).mm(w)
        return y, torch.sin(y)

    def fn(x: torch.Tensor, w: torch.Tensor, context_fn: Any) -> torch.Tensor:
        if context_fn == "full":
            y, z = checkpoint(region, x, w, use_reentrant=False)
        else:
            y, z = checkpoint(region, x, w, use_reentrant=False, context_fn=context_fn)
        y.mul_(3.0)
        return (y * z).sum()

    def grads(context_fn: Any) -> list[torch.Tensor]:
        x.grad = w.grad = None
        fn(x, w, context_fn).backward()
        return [x.grad.clone(), w.grad.clone()]

    expected = grads("full")
    _assert_equal(grads(selective_context_fn()), expected)
    if through_alias:
        assert any(not torch.equal(g, e) for g, e in zip(grads(_unguarded_selective), expected))
    else:
        with pytest.raises(RuntimeError, match="has been mutated"):
            grads(_unguarded_selective)


def test_in_place_ops_are_never_cached() -> None:
    """A cached in-place op would stand in for the call in recompute and the write into its input would be lost."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the _c10d_functional ops)

    x = torch.randn(4, 8)
    for op in (torch.ops._c10d_functional.all_reduce_.default, torch.ops._c10d_functional.broadcast_.default):
        decision, saved, reason = SelectivePolicy().decide(op, (x, "sum", "0"), {}, x)
        assert (decision, saved) == (Decision.RECOMPUTE, False), op
        assert reason.startswith("writes into an input")
    assert _decide(aten.mm.out, x, x.T, out=torch.empty(4, 4)) == (Decision.RECOMPUTE, False)

    # Any policy under mutation_safe_contexts: even MUST_SAVE of an in-place op is overridden.
    def save_everything(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE

    w = torch.randn(8, 8, requires_grad=True)

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x @ w
        g = h.clone()
        g.add_(1.0)  # returns g; recompute must still write into the recomputed g
        return (g * h).tanh() * g

    expected = _grads(fn, [x.requires_grad_(), w], None)
    _assert_equal(_grads(fn, [x, w], lambda: mutation_safe_contexts(save_everything)), expected)
    with pytest.raises(RuntimeError, match="has been mutated"):  # torch's own contexts: the cached add_ is stale
        _grads(fn, [x, w], lambda: create_selective_checkpoint_contexts(save_everything))


def test_models_without_in_place_writes_downgrade_nothing() -> None:
    model = tiny_llama()
    checkpoint_layers(model, selective_context_fn(trace=True))
    llama_step(model, torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3)))
    summary = selective_trace_summary()
    assert any(r.saved for r in summary)
    assert all(r.downgraded == 0 for r in summary)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "expected"),
    [
        ("mixtral", "DOWNGRADE aten.topk.default  saved output later written in place (by aten.div_.Tensor in the "
         "forward): recomputed in backward instead"),
        ("gemma3n_text", "DOWNGRADE aten.bmm.default  saved output later written in place (by aten.add_.Tensor in "
         "the forward): recomputed in backward instead"),
    ],
)
def test_real_models_trace_their_downgrades(arch: str, expected: str, caplog: pytest.LogCaptureFixture) -> None:
    """Mixtral divides its router's topk values in place; gemma3n's AltUp adds into a bmm output through
    torch.matmul's _unsafe_view (modeling_gemma3n.py: ``predictions += hidden_states``). The exact gradients are
    asserted by test_gradients.py; here the trace names the write."""
    from ckpt_models import batch, tiny_model

    model = tiny_model(arch, num_layers=2)
    checkpoint_layers(model, selective_context_fn(trace=True))
    ids = batch()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert expected in [r.getMessage() for r in caplog.records]
