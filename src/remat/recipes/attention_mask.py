"""Dropping an attention mask that changes nothing, so that no dense ``[tokens, tokens]`` mask is ever built for it.

Given an ``attention_mask`` with a zero anywhere, transformers' SDPA and eager paths build a 4-D mask of
``batch x tokens x tokens`` elements (one byte each for SDPA's boolean mask): 1 TB at a million tokens. A row that is
*right*-padded (ones, then zeros: what ``dataset.packing: false`` produces) does not need it in a causal LM: a real
token attends only to the tokens before it, which are all real, and the padding positions carry the label -100, so
they contribute nothing to the loss or to any gradient. Dropping such a mask leaves the loss and the gradients as
they are (to the rounding of another attention kernel) and lets the model run its causal kernel with no mask. A mask
of ones only is dropped too (transformers would skip it anyway). Left padding or holes are kept as given.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from remat.models.document_attention import is_right_padding

__all__ = ["is_right_padding", "without_redundant_mask"]


def without_redundant_mask(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """``inputs`` without its ``attention_mask`` when that mask is right padding only (see the module docstring)."""
    out = dict(inputs)
    mask = out.get("attention_mask")
    if isinstance(mask, torch.Tensor) and is_right_padding(mask):
        del out["attention_mask"]
    return out
