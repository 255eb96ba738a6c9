"""The named choices of an estimate (what device it models, the short loss names), in a module without torch: the
command line's help lists them before anything heavy is imported."""

from __future__ import annotations

from typing import Final, Literal

Target = Literal["cuda", "cpu"]
#: What an estimate models: a CUDA GPU (its caching allocator) or the CPU as it runs here.
TARGETS: Final[tuple[str, ...]] = ("cuda", "cpu")

LOSS_TARGETS: Final[dict[str, str]] = {
    "plain": "remat.loss.MaskedCrossEntropy",
    "fused": "remat.loss.FusedLinearCrossEntropy",
}
"""Short names for the two remat losses; any loss target a recipe allows may be given by its dotted path."""


def short_loss(target: str) -> str:
    """``plain`` / ``fused`` for the two remat losses (by name or target), anything else as given."""
    return {t: name for name, t in LOSS_TARGETS.items()}.get(target, target)
