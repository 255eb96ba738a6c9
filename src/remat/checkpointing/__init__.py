"""Activation checkpointing: policies (what to recompute), discovery (where the blocks are), and wrapping.

Start with `apply_activation_checkpointing(model, policy)`; it returns a `CheckpointPlan` saying what each block got.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "CheckpointPolicy": "remat.checkpointing.policy",
    "CheckpointPlan": "remat.checkpointing.plan",
    "LayerPlan": "remat.checkpointing.plan",
    "CheckpointingWarning": "remat.checkpointing.plan",
    "MoESelectiveWarning": "remat.checkpointing.plan",
    "apply_activation_checkpointing": "remat.checkpointing.apply",
    "remove_activation_checkpointing": "remat.checkpointing.apply",
    "parse_policy": "remat.checkpointing.policy",
    "is_checkpointed": "remat.checkpointing.apply",
}

__all__ = [
    "CheckpointPlan",
    "CheckpointPolicy",
    "CheckpointingWarning",
    "LayerPlan",
    "MoESelectiveWarning",
    "apply_activation_checkpointing",
    "is_checkpointed",
    "parse_policy",
    "remove_activation_checkpointing",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.checkpointing.apply import (
        apply_activation_checkpointing,
        is_checkpointed,
        remove_activation_checkpointing,
    )
    from remat.checkpointing.plan import CheckpointPlan, CheckpointingWarning, LayerPlan, MoESelectiveWarning
    from remat.checkpointing.policy import CheckpointPolicy, parse_policy
