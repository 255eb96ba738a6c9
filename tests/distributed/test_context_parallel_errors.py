"""Context parallelism refuses what it cannot split, in one line naming ``distributed.cp_size`` and what is allowed;
and it cuts rows as documented (padding, positions, next-token targets), all without a process group."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from cp_cases import tiny_model

from remat.distributed import context_parallel
from remat.distributed.context_parallel import ContextShards, check_every_block_attends
from remat.errors import ConfigError
from remat.loss import MaskedCrossEntropy
from remat.recipes.model_loss import CausalLMLoss


def shards(size: int, rank: int = 0) -> ContextShards:
    return ContextShards(group=None, size=size, rank=rank)  # type: ignore[arg-type]  # no collective runs here


@pytest.fixture(autouse=True)
def _no_active_group() -> Any:
    yield
    context_parallel.disable()


def test_heads_that_do_not_divide_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^distributed.cp_size: 3 must divide the model's attention heads \(4\); "
                                          r"allowed: a divisor of 4$"):
        context_parallel.enable(tiny_model("llama"), shards(3))


def test_an_attention_implementation_it_cannot_wrap_is_refused() -> None:
    model = tiny_model("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match=r"distributed.cp_size: 2 needs the sdpa or eager attention implementation; "
                                          r"the model runs 'flex_attention' \(set model.attn_implementation"):
        context_parallel.enable(model, shards(2))


def test_enabling_switches_the_model_and_keeps_document_attention_inside() -> None:
    model = tiny_model("llama-eager")
    assert context_parallel.enable(model, shards(2)) == "remat_cp_eager"
    assert model.config._attn_implementation == "remat_cp_eager"
    assert context_parallel.active().size == 2


def test_a_block_that_never_ran_split_attention_is_refused() -> None:
    cp = shards(2)
    cp.attention_calls = 3
    with pytest.raises(ConfigError, match=r"distributed.cp_size: 2: only 1 of the model's 4 blocks ran attention that "
                                          r"can be split .* allowed for this model: cp_size 1"):
        check_every_block_attends(cp, 2, 4)
    check_every_block_attends(cp, 0, 3)


def test_a_loss_without_next_token_targets_is_refused() -> None:
    def my_loss(logits: torch.Tensor, labels: torch.Tensor, num_label_tokens: int | None = None) -> torch.Tensor:
        raise AssertionError("never called")

    with pytest.raises(ConfigError, match=r"distributed.cp_size: 2 needs a loss that takes next-token targets \(a "
                                          r"`shift` keyword\); my_loss has none; allowed: remat.loss.MaskedCrossEntropy"):
        CausalLMLoss(tiny_model("llama"), my_loss, use_hidden_states=False, context=shards(2))
    CausalLMLoss(tiny_model("llama"), MaskedCrossEntropy(), use_hidden_states=False, context=shards(2))


def test_a_left_padding_mask_is_refused() -> None:
    inputs = {"input_ids": torch.ones(1, 4, dtype=torch.long), "attention_mask": torch.tensor([[0, 1, 1, 1]])}
    with pytest.raises(ConfigError, match=r"distributed.cp_size: 2 cannot take an attention_mask with left padding"):
        shards(2).shard(inputs, torch.ones(1, 4, dtype=torch.long), ignore_index=-100)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_row_is_padded_cut_and_labelled_with_the_next_tokens(rank: int) -> None:
    """7 tokens over 3 ranks: padded to 9 (positions go on, targets ignored); rank r gets tokens 3r..3r+2 and the
    targets of those positions (the next token, across the cut)."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    labels = torch.tensor([[10, 11, 12, -100, 14, 15, 16]])
    cp = shards(3, rank)
    inputs, targets = cp.shard({"input_ids": ids, "position_ids": positions}, labels, ignore_index=-100)
    want_ids = [[10, 11, 12], [13, 14, 15], [16, 0, 0]][rank]
    want_positions = [[0, 1, 2], [0, 1, 2], [3, 4, 5]][rank]
    want_targets = [[11, 12, -100], [14, 15, 16], [-100, -100, -100]][rank]
    assert inputs["input_ids"].tolist() == [want_ids] and inputs["position_ids"].tolist() == [want_positions]
    assert targets.tolist() == [want_targets]
    full = cp.full_positions(inputs["position_ids"])  # found by identity: no collective
    assert full is not None and full.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5]]


def test_heads_must_divide_by_cp_times_tp() -> None:
    from remat.distributed.layout import check_heads

    check_heads(8, 2, 2)
    check_heads(None, 3)  # a config without the attribute: the first forward checks what runs
    with pytest.raises(ConfigError, match=r"^distributed.cp_size: 4 x tp_size 2 must divide the model's attention "
                                          r"heads \(12: each tensor-parallel rank's 6 are split over the "
                                          r"context-parallel ranks\); allowed: a product that divides 12$"):
        check_heads(12, 4, 2)
