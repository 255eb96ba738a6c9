"""A right-padding attention mask is dropped before the model runs (no dense [tokens, tokens] mask is built), with
the loss and the gradients unchanged; other masks are passed as given."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from remat.data import IGNORE_INDEX
from remat.loss import FusedLinearCrossEntropy, MaskedCrossEntropy
from remat.recipes.attention_mask import is_right_padding, without_redundant_mask
from remat.recipes.model_loss import CausalLMLoss


@pytest.mark.parametrize(("rows", "expected"), [
    ([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], True),
    ([[1, 1, 1, 1, 1]], True),
    ([[0, 0, 1, 1, 1]], False),  # left padding
    ([[1, 0, 1, 1, 0]], False),  # a hole
    ([[2, 1, 0, 0, 0]], False),  # not 0/1
])
def test_right_padding_is_recognised(rows: list[list[int]], expected: bool) -> None:
    mask = torch.tensor(rows)
    assert is_right_padding(mask) is expected
    assert is_right_padding(mask.bool()) is (expected or rows == [[2, 1, 0, 0, 0]])
    assert ("attention_mask" in without_redundant_mask({"attention_mask": mask})) is not expected


def _model() -> torch.nn.Module:
    config = AutoConfig.for_model("llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _batch(left: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(3, 50, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    if left:
        mask[0, :5] = 0
    else:
        mask[0, 7:] = 0
    ids[mask == 0] = 2
    labels = torch.where(mask == 1, ids, torch.full_like(ids, IGNORE_INDEX))
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "position_ids": torch.arange(12).expand(2, 12).clone()}


def _seen_masks(model: torch.nn.Module) -> list[Any]:
    seen: list[Any] = []
    model.model.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    return seen


@pytest.mark.parametrize("fused", [False, True])
def test_a_dropped_right_padding_mask_leaves_loss_and_gradients_unchanged(fused: bool) -> None:
    batch = _batch()
    reference = _model()
    out = reference(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False)
    expected_loss = MaskedCrossEntropy()(out.logits, batch["labels"])
    expected_loss.backward()
    expected = {n: p.grad.clone() for n, p in reference.named_parameters()}

    model = _model()
    loss_fn = FusedLinearCrossEntropy() if fused else MaskedCrossEntropy()
    compute = CausalLMLoss(model, loss_fn, use_hidden_states=fused)  # (the fused loss's head probe runs here)
    seen = _seen_masks(model)
    loss = compute(batch)
    loss.backward()
    assert seen == [None]  # the model ran without a mask: no [tokens, tokens] mask was built
    torch.testing.assert_close(loss, expected_loss)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], msg=lambda m, n=name: f"{n}: {m}")


def test_a_left_padding_mask_is_passed_as_given() -> None:
    model = _model()
    seen = _seen_masks(model)
    batch = _batch(left=True)
    CausalLMLoss(model, MaskedCrossEntropy(), use_hidden_states=False)(batch)
    assert len(seen) == 1 and torch.equal(seen[0], batch["attention_mask"])
