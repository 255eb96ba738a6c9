"""Causal-LM losses: the plain masked cross-entropy and the fused linear cross-entropy that never holds the logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "FusedLinearCrossEntropy": "remat.loss.fused",
    "MaskedCrossEntropy": "remat.loss.masked",
    "loss_input": "remat.loss.contract",
    "output_head": "remat.loss.head",
    "verify_output_head": "remat.loss.head",
}

__all__ = [
    "FusedLinearCrossEntropy",
    "MaskedCrossEntropy",
    "loss_input",
    "output_head",
    "verify_output_head",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.loss.contract import loss_input
    from remat.loss.fused import FusedLinearCrossEntropy
    from remat.loss.head import output_head, verify_output_head
    from remat.loss.masked import MaskedCrossEntropy
