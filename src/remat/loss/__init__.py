"""Causal-LM losses: the plain masked cross-entropy and the fused linear cross-entropy that never holds the logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "BACKENDS": "remat.loss.backends",
    "Backend": "remat.loss.backends",
    "KernelRequest": "remat.loss.backends",
    "select_backend": "remat.loss.backends",
    "DEFAULT_CHUNK_BYTES": "remat.loss.chunked",
    "FAST_CHUNK_BYTES": "remat.loss.chunked",
    "ChunkPlan": "remat.loss.chunked",
    "GradStrategy": "remat.loss.chunked",
    "auto_token_chunk": "remat.loss.chunked",
    "auto_vocab_chunk": "remat.loss.chunked",
    "plan_chunks": "remat.loss.chunked",
    "FusedLinearCrossEntropy": "remat.loss.fused",
    "OutputHead": "remat.loss.head",
    "output_head": "remat.loss.head",
    "verify_output_head": "remat.loss.head",
    "MaskedCrossEntropy": "remat.loss.masked",
    "LOSS_INPUTS": "remat.loss.contract",
    "LossInput": "remat.loss.contract",
    "Reduction": "remat.loss.targets",
    "loss_input": "remat.loss.contract",
    "next_token_targets": "remat.loss.targets",
}

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
    "verify_output_head",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
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
    from remat.loss.head import OutputHead, output_head, verify_output_head
    from remat.loss.masked import MaskedCrossEntropy
    from remat.loss.contract import LOSS_INPUTS, LossInput, loss_input
    from remat.loss.targets import Reduction, next_token_targets
