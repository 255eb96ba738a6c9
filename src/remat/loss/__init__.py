"""Causal-LM losses: the plain masked cross-entropy and the fused linear cross-entropy that never holds the logits."""

from __future__ import annotations

from remat.loss.backends import BACKENDS, Backend, KernelRequest, select_backend
from remat.loss.chunked import (
    DEFAULT_CHUNK_BYTES,
    FAST_CHUNK_BYTES,
    ChunkPlan,
    GradStrategy,
    auto_token_chunk,
    auto_vocab_chunk,
    plan_chunks,
)
from remat.loss.fused import FusedLinearCrossEntropy
from remat.loss.head import OutputHead, output_head
from remat.loss.masked import MaskedCrossEntropy
from remat.loss.targets import LOSS_INPUTS, LossInput, Reduction, loss_input, next_token_targets

__all__ = [
    "BACKENDS",
    "LOSS_INPUTS",
    "DEFAULT_CHUNK_BYTES",
    "FAST_CHUNK_BYTES",
    "Backend",
    "ChunkPlan",
    "FusedLinearCrossEntropy",
    "GradStrategy",
    "KernelRequest",
    "LossInput",
    "MaskedCrossEntropy",
    "OutputHead",
    "Reduction",
    "auto_token_chunk",
    "auto_vocab_chunk",
    "loss_input",
    "next_token_targets",
    "output_head",
    "plan_chunks",
    "select_backend",
]
