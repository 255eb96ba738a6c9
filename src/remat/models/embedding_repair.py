"""Repair of input-embedding rows that a checkpoint left at (or near) zero: ``model.embedding_row_repair``.

A checkpoint whose tokenizer gained tokens after training can hold rows of zeros (or non-finite values) for them in
the input embeddings; such a token then enters the first block as nothing. Each such row (L2 norm not finite, or at
most ``min_norm``) takes the direction of the same token's row of the output embeddings, scaled to the RMS norm of the
healthy input rows: a token-specific direction at the magnitude the model expects (NeMo AutoModel's
``embedding_row_repair``). Runs once on the pretrained weights as loaded, before anything wraps or shards them; more
than ``max_rows`` damaged rows means another checkpoint than the one meant, and is refused.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pydantic import NonNegativeFloat, PositiveInt

from remat.config_base import StrictModel
from remat.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger(__name__)

_KEY = "model.embedding_row_repair"


class EmbeddingRowRepair(StrictModel):
    """``model.embedding_row_repair``: which input-embedding rows count as damaged, and how many may be repaired."""

    min_norm: NonNegativeFloat = 1e-6
    max_rows: PositiveInt = 256


def repair_embedding_rows(model: nn.Module, cfg: EmbeddingRowRepair) -> list[int]:
    """Repair ``model``'s damaged input-embedding rows in place (one WARNING line naming them); return their ids.
    `ConfigError` in one line when more than ``max_rows`` are damaged, the embeddings are tied to the output head
    (no other row to take a direction from), or a damaged row's output row is damaged too."""
    import torch

    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    weight = embeddings.weight
    with torch.no_grad():
        norms = weight.float().norm(dim=1)
        damaged = ~torch.isfinite(norms) | (norms <= cfg.min_norm)
        ids = damaged.nonzero().flatten()
        if ids.numel() == 0:
            return []
        if ids.numel() > cfg.max_rows:
            raise ConfigError(f"{_KEY}.max_rows: {ids.numel()} input-embedding rows have a norm of at most "
                              f"{cfg.min_norm:g} (or are not finite), more than {cfg.max_rows}: likely another "
                              "checkpoint than the one meant; allowed: a larger max_rows, if this one is right")
        if head is None or head.weight is weight or head.weight.shape != weight.shape:
            raise ConfigError(f"{_KEY}: {ids.numel()} damaged input-embedding rows, but the output embeddings are "
                              "tied to them (or absent): no other row to take a direction from; allowed: remove "
                              "the key")
        source = head.weight.float()[ids]
        source_norms = source.norm(dim=1)
        if not bool((torch.isfinite(source_norms) & (source_norms > cfg.min_norm)).all()):
            raise ConfigError(f"{_KEY}: the output-embedding rows of damaged input rows are damaged too "
                              f"({ids[:8].tolist()}...); allowed: remove the key")
        target = norms[~damaged].pow(2).mean().sqrt()
        weight[ids] = (source * (target / source_norms).unsqueeze(1)).to(weight.dtype)
    repaired = ids.tolist()
    logger.warning("%s: repaired %d input-embedding rows from the output embeddings (ids %s%s), at norm %.3g", _KEY,
                   len(repaired), repaired[:16], "..." if len(repaired) > 16 else "", float(target))
    return repaired
