"""Streamed offload keeps O(1) block inputs on the device: with ``{mode: full, offload: true}`` each block's kept
input goes to host memory once the block has run and comes back (prefetched) just before its backward, so at most
``prefetch + 1`` block inputs are on the device at any moment of forward and backward (measured: 3 with the default
prefetch of 2, 6 with 5, 2 with 0; in forward 2); without offload full checkpointing keeps all N. Run on the CPU, where the offload context copies CPU tensors to host buffers that stand
for pinned host memory (and the CPU tensors stand for device ones)."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
from ckpt_models import BATCH, SEQ, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from remat.checkpointing import apply_activation_checkpointing
from remat.checkpointing.offload import OffloadActivations

LAYERS = 8
PREFETCH = 2


class _ResidentBlockInputs(TorchDispatchMode):
    """Counts, after every op, the block inputs alive on the "device": the inputs of the blocks' forward (weakly
    held), plus the tensors restored from their host copies (the outputs of ops that read a host buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[weakref.ref[Any]] = []
        self.host: weakref.WeakSet[Any] = weakref.WeakSet()
        self.allocating_host = False
        self.most = 0

    def host_scope(self) -> Any:
        mode = self

        class _Scope:
            def __enter__(self) -> None:
                mode.allocating_host = True

            def __exit__(self, *exc: object) -> None:
                mode.allocating_host = False

        return _Scope()

    def resident(self) -> int:
        return sum(ref() is not None for ref in self.inputs)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            if self.allocating_host:
                self.host.add(out.untyped_storage())
            elif any(isinstance(a, torch.Tensor) and a.untyped_storage() in self.host for a in args):
                self.inputs.append(weakref.ref(out.untyped_storage()))  # a block input restored from the host
        self.most = max(self.most, self.resident())
        return out


def _most_resident(offload: bool) -> tuple[int, int]:
    """(most block inputs on the device at once, blocks whose input was offloaded) over one forward + backward."""
    model = tiny_model("llama", num_layers=LAYERS)
    counter = _ResidentBlockInputs()
    context = OffloadActivations(copy_cpu_tensors=True, min_bytes=0, prefetch=PREFETCH, module=model,
                                 host_scope=counter.host_scope)
    apply_activation_checkpointing(model, {"mode": "full", "offload": offload}, offload_context=context)

    def remember_input(_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        if torch._C._current_graph_task_id() == -1:  # the forward, not the recompute
            counter.inputs.append(weakref.ref(hidden.untyped_storage()))

    for layer in model.model.layers:
        layer.register_forward_pre_hook(remember_input, with_kwargs=True)
    ids = torch.randint(0, 100, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with counter:
        out = model(input_ids=ids, labels=ids, use_cache=False)
        at_loss = counter.resident()
        out.loss.backward()
    assert counter.resident() == 0  # nothing of them outlives the step
    assert counter.most >= at_loss
    return counter.most, context.stats.offloaded_tensors


@pytest.mark.parametrize("offload", [False, True])
def test_streamed_offload_keeps_a_bounded_number_of_block_inputs_on_the_device(offload: bool) -> None:
    most, offloaded = _most_resident(offload)
    if offload:
        assert offloaded == LAYERS  # each block's input, once
        assert most <= PREFETCH + 1, most  # the one backward uses and the ones prefetched; forward: this one and the next
    else:
        assert offloaded == 0
        assert most == LAYERS  # full checkpointing alone keeps every block's input until its backward
