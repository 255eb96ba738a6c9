"""The per-version adapter over torch's selective-checkpoint cache (remat.checkpointing.sac_layout), checked entry by
entry on the running torch. CI runs this file on torch 2.11 (queue layout) and 2.13/2.15 (indexed layout): each
layout's test runs on its versions and is skipped, naming the torch version, elsewhere."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, checkpoint

from remat.checkpointing import sac_layout as layout_module
from remat.checkpointing.sac_layout import IndexedLayout, QueueLayout, sac_layout
from remat.checkpointing.selective import POLICY_SEES_OUTPUT, mutation_safe_contexts
from remat.errors import CheckpointingError

aten = torch.ops.aten
TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
# The layouts of the torch versions CI runs; another torch in the supported range must still be detected as one.
EXPECTED = {(2, 11): "queue", (2, 13): "indexed", (2, 15): "indexed"}


def test_this_torch_has_a_known_layout() -> None:
    layout = sac_layout()
    if TORCH in EXPECTED:
        assert layout.name == EXPECTED[TORCH], f"torch {torch.__version__} changed its selective-checkpoint cache"
    assert POLICY_SEES_OUTPUT == (TORCH >= (2, 13) if TORCH in EXPECTED else POLICY_SEES_OUTPUT)


class _Recorder:
    """Saves every mm; remembers whether each call came from the forward or the recompute."""

    def __init__(self) -> None:
        self.recompute_flags: list[bool] = []

    def __call__(self, ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        self.recompute_flags.append(ctx.is_recompute)
        return CheckpointPolicy.MUST_SAVE if op is aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


def _mutating_region(w: torch.Tensor):
    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x.mm(w)
        h.add_(1.0)  # written after it was cached: the first mm's entry leaves the cache at the exit of the forward
        return x.mm(w).sin() * h.cos()  # the second mm stays cached

    return fn


def _run(observe_outputs: bool | None) -> tuple[Any, Any, _Recorder, list[torch.Tensor]]:
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    policy = _Recorder()
    forward, recompute = mutation_safe_contexts(policy, observe_outputs=observe_outputs)
    y = checkpoint(_mutating_region(w), x, use_reentrant=False, context_fn=lambda: (forward, recompute))
    return forward, y, policy, [x, w]


def _expected_grads() -> list[torch.Tensor]:
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    _mutating_region(w)(x).sum().backward()
    return [x.grad, w.grad]


@pytest.mark.skipif(sac_layout().name != "indexed", reason=f"torch {torch.__version__} caches as a queue")
def test_indexed_layout_entry_by_entry() -> None:
    forward, y, policy, inputs = _run(None)
    storage = forward.inner.storage
    assert isinstance(sac_layout(), IndexedLayout)
    # {op key: {call index: entry}}: the written mm became the sentinel, the other is a _VersionWrapper
    assert storage[aten.mm.default][0] is torch_checkpoint._RECOMPUTE
    cached = storage[aten.mm.default][1]
    assert isinstance(cached, torch_checkpoint._VersionWrapper) and cached.version == cached.val._version
    assert storage[aten.sin.default][0] is torch_checkpoint._RECOMPUTE
    calls = len(policy.recompute_flags)
    y.sum().backward()
    assert len(policy.recompute_flags) == calls and not any(policy.recompute_flags)  # replayed by index
    for got, want in zip([t.grad for t in inputs], _expected_grads(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(sac_layout().name != "queue", reason=f"torch {torch.__version__} caches by call index")
def test_queue_layout_entry_by_entry() -> None:
    forward, y, policy, inputs = _run(None)
    storage = forward.inner.storage
    assert isinstance(sac_layout(), QueueLayout)
    # {op: [entry per saved call]}: the written mm left the queue, the second one is the only entry
    queue = storage[aten.mm.default]
    assert len(queue) == 1 and isinstance(queue[0], torch_checkpoint._VersionWrapper)
    assert queue[0].version == queue[0].val._version
    assert forward.guard.forward_saved[aten.mm.default] == [False, True]
    assert not storage.get(aten.sin.default)
    calls = len(policy.recompute_flags)
    y.sum().backward()
    # torch asks again in the recompute; the guard answers with the forward's decisions, the policy is not asked
    assert len(policy.recompute_flags) == calls and not any(policy.recompute_flags)
    assert queue == []
    for got, want in zip([t.grad for t in inputs], _expected_grads(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("observe_outputs", [True, False])
def test_guard_sees_outputs_either_way(observe_outputs: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Outputs reach the guard through ctx.op_output (torch 2.13+) or through remat's own dispatch mode (public
    API, the only way on torch 2.11); both paths are exact on every torch that has them."""
    if not observe_outputs and not POLICY_SEES_OUTPUT:
        pytest.skip(f"torch {torch.__version__} asks the policy before the op: no ctx.op_output")
    forward, y, _, inputs = _run(observe_outputs)
    assert (forward.observer is not None) == observe_outputs
    with caplog.at_level(logging.WARNING):
        y.sum().backward()
    for got, want in zip([t.grad for t in inputs], _expected_grads(), strict=True):
        assert torch.equal(got, want)


def test_unknown_layout_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layout_module, "_detected", [])
    monkeypatch.delattr(torch_checkpoint, "_VersionWrapper")
    with pytest.raises(CheckpointingError, match=rf"torch {re.escape(torch.__version__)} changed it: .*_VersionWrapper is gone"):
        sac_layout()


def test_indexed_storage_without_its_sentinel_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    if sac_layout().name != "indexed":
        pytest.skip(f"torch {torch.__version__} caches as a queue, without a sentinel")
    monkeypatch.setattr(layout_module, "_detected", [])
    monkeypatch.delattr(torch_checkpoint, "_RECOMPUTE")
    with pytest.raises(CheckpointingError, match=r"indexed by call but torch.utils.checkpoint._RECOMPUTE is gone"):
        sac_layout()


class _Wrapper:
    """Stands for torch's _VersionWrapper (.val, .version) so the queue logic runs on every torch."""

    def __init__(self, val: torch.Tensor) -> None:
        self.val, self.version = val, val._version


def test_queue_drop_keeps_the_others_in_call_order_and_marks_recompute() -> None:
    layout = QueueLayout(version_wrapper=_Wrapper)
    a, b, c = (_Wrapper(torch.full((1,), float(i))) for i in range(3))
    storage: dict[Any, Any] = {aten.mm.default: [a, b, c]}
    forward_saved = {aten.mm.default: [True, False, True, True]}  # calls 0, 2, 3 were cached
    entries = list(layout.cached(storage, forward_saved))
    assert [e.slot for e in entries] == [0, 2, 3]
    layout.drop(storage, forward_saved, [entries[1]])
    assert storage[aten.mm.default] == [a, c]
    assert forward_saved[aten.mm.default] == [True, False, False, True]


def test_queue_that_does_not_match_the_decisions_is_a_clear_error() -> None:
    layout = QueueLayout(version_wrapper=_Wrapper)
    storage = {aten.mm.default: [_Wrapper(torch.zeros(1))]}
    with pytest.raises(CheckpointingError, match=r"cached 1 outputs of aten.mm.default but the policy saved 0"):
        list(layout.cached(storage, {aten.mm.default: [False]}))
