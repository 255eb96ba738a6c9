"""What a plan must say about itself: choices the measurements justify but the project's guidance warns about.

Selective checkpointing on mixture-of-experts blocks: the seed documents advise full checkpointing for MoE (the
experts dominate the block, and with expert parallelism the dispatch is recomputed whatever selective saves), and
keep selective as an opt-in. remat has no expert parallelism, and the planner prices each mode on the block itself
(bytes kept, FLOPs recomputed), so it may still pick selective where that measures better; the plan then says so,
with the figures, and how to opt out.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat.checkpointing.policy import Mode
from remat.planner.measure import BlockMeasurements


def moe_selective_note(modes: Sequence[Mode], measurements: BlockMeasurements) -> str | None:
    """The note for a plan giving ``selective`` to mixture-of-experts blocks (None when it gives none)."""
    chosen = [i for i, mode in enumerate(modes) if mode == "selective" and measurements.kind_of(i).is_moe]
    if not chosen:
        return None
    kind = measurements.kind_of(chosen[0])
    selective, full = kind.cost("selective"), kind.cost("full")
    blocks = ", ".join(str(i) for i in chosen)
    return (f"selective on mixture-of-experts blocks {blocks}: measured to keep {selective.kept_bytes:,} bytes per "
            f"block (full keeps {full.kept_bytes:,}) and recompute {selective.recompute_flops:,} FLOPs (full "
            f"{full.recompute_flops:,}), so it fits the budget for less recompute; the seed guidance prefers full for "
            "MoE (with expert parallelism the expert dispatch is recomputed anyway, which this plan does not model). "
            "To follow it, give distributed.activation_checkpointing: full (or a per-layer policy) instead of auto")
