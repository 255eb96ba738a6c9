"""From policy and blocks to the per-block plan, without any model: modes, offload flags, segments, fallbacks."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from torch import nn

from remat.checkpointing import CheckpointingWarning, parse_policy
from remat.checkpointing.discovery import Block, BlockSearch
from remat.checkpointing.resolve import resolve_plan
from remat.errors import CheckpointingError


def _blocks(
    n: int, *, store: tuple[int, ...] = (), moe: tuple[int, ...] = (), no_mlp: tuple[int, ...] = ()
) -> BlockSearch:
    blocks = tuple(
        Block(
            index=i, name=f"layers.{i}", module=nn.Identity(), attention=("self_attn",),
            mlp=() if i in no_mlp else ("mlp",), kv_sharing="store" if i in store else None, is_moe=i in moe,
        )
        for i in range(n)
    )
    return BlockSearch(blocks, "layers", "ModuleList")


def _plan(policy: Any, search: BlockSearch) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointingWarning)
        return resolve_plan(parse_policy(policy), search, "Model")


def test_every_n_with_exceptions_and_offload_flags() -> None:
    plan = _plan({"mode": "selective", "every_n_layers": 3, "offload": True,
                  "layers": {"1": "offload", "4-5": {"mode": "attention", "offload": False}}}, _blocks(7))
    got = [(layer.mode, layer.offload, layer.wrapped) for layer in plan]
    assert got == [
        ("selective", True, ("layers.0",)),
        ("offload", True, ("layers.1",)),
        ("none", False, ()),
        ("selective", True, ("layers.3",)),
        ("attention", False, ("layers.4.self_attn",)),
        ("attention", False, ("layers.5.self_attn",)),
        ("selective", True, ("layers.6",)),
    ]
    assert [layer.note for layer in plan][1:3] == ["layers['1']", "every_n_layers=3: not selected"]


@pytest.mark.parametrize(("mode", "expected"), [("full", "mlp"), ("selective", "mlp"), ("attention", "mlp"),
                                                 ("mlp", "mlp"), ("offload", "offload")])
def test_kv_producers_never_recompute_attention(mode: str, expected: str) -> None:
    plan = _plan(mode, _blocks(3, store=(1,)))
    assert plan.layers[1].mode == expected and plan.layers[1].requested == mode
    assert (plan.layers[1].wrapped == ("layers.1.mlp",)) == (expected == "mlp")
    assert plan.layers[0].mode == mode


def test_kv_producer_without_mlp_is_left_alone_and_said() -> None:
    plan = _plan("full", _blocks(3, store=(1,), no_mlp=(1,)))
    assert plan.layers[1].mode == "none" and "no MLP found" in plan.layers[1].note


def test_segments_split_around_kv_producers() -> None:
    plan = _plan({"segments": 2}, _blocks(8, store=(2,)))
    assert [layer.segment for layer in plan] == [(0, 1), (0, 1), None, (3, 3), (4, 7), (4, 7), (4, 7), (4, 7)]
    assert plan.segments == ((0, 1), (3, 3), (4, 7))
    assert plan.shard_groups() == (("layers.0", "layers.1"), ("layers.2",), ("layers.3",),
                                   ("layers.4", "layers.5", "layers.6", "layers.7"))


def test_moe_selective_is_noted_and_warned() -> None:
    with pytest.warns(CheckpointingWarning, match="selective checkpointing on 2 mixture-of-experts blocks"):
        plan = resolve_plan(parse_policy("selective"), _blocks(3, moe=(0, 2)), "Model")
    assert ["MoE block" in layer.note for layer in plan] == [True, False, True]


def test_attention_missing_in_one_block_names_it() -> None:
    search = _blocks(3)
    broken = Block(1, "layers.1", nn.Linear(2, 2), (), ("mlp",), None, False)
    search = BlockSearch((search.blocks[0], broken, search.blocks[2]), "layers", "ModuleList")
    with pytest.raises(CheckpointingError, match=r"no attention sub-module found in block 1 \(layers\.1, Linear\)"):
        _plan("attention", search)
    assert _plan({"mode": "attention", "layers": {"1": "mlp"}}, search).layers[1].wrapped == ("layers.1.mlp",)
