"""Activation checkpointing: policies (what to recompute), discovery (where the blocks are), and wrapping.

Start with `apply_activation_checkpointing(model, policy)`; it returns a `CheckpointPlan` saying what each block got.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "apply_activation_checkpointing": "remat.checkpointing.apply",
    "is_checkpointed": "remat.checkpointing.apply",
    "remove_activation_checkpointing": "remat.checkpointing.apply",
    "Block": "remat.checkpointing.discovery",
    "BlockSearch": "remat.checkpointing.discovery",
    "find_attention": "remat.checkpointing.discovery",
    "find_blocks": "remat.checkpointing.discovery",
    "find_decoder": "remat.checkpointing.discovery",
    "find_mlp": "remat.checkpointing.discovery",
    "find_norms": "remat.checkpointing.discovery",
    "is_moe_block": "remat.checkpointing.discovery",
    "kv_sharing_role": "remat.checkpointing.discovery",
    "CheckpointingWarning": "remat.checkpointing.plan",
    "MoESelectiveWarning": "remat.checkpointing.plan",
    "planned_policy": "remat.checkpointing.plan",
    "CheckpointPlan": "remat.checkpointing.plan",
    "LayerPlan": "remat.checkpointing.plan",
    "MODES": "remat.checkpointing.policy",
    "POLICY_KEYS": "remat.checkpointing.policy",
    "POLICY_STRINGS": "remat.checkpointing.policy",
    "CheckpointPolicy": "remat.checkpointing.policy",
    "LayerOverride": "remat.checkpointing.policy",
    "parse_policy": "remat.checkpointing.policy",
}

__all__ = [
    "MODES",
    "POLICY_KEYS",
    "POLICY_STRINGS",
    "Block",
    "BlockSearch",
    "CheckpointPlan",
    "CheckpointPolicy",
    "CheckpointingWarning",
    "LayerOverride",
    "LayerPlan",
    "MoESelectiveWarning",
    "apply_activation_checkpointing",
    "find_attention",
    "find_blocks",
    "find_decoder",
    "find_mlp",
    "find_norms",
    "is_checkpointed",
    "is_moe_block",
    "kv_sharing_role",
    "parse_policy",
    "planned_policy",
    "remove_activation_checkpointing",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.checkpointing.apply import apply_activation_checkpointing, is_checkpointed, remove_activation_checkpointing
    from remat.checkpointing.discovery import (
        Block,
        BlockSearch,
        find_attention,
        find_blocks,
        find_decoder,
        find_mlp,
        find_norms,
        is_moe_block,
        kv_sharing_role,
    )
    from remat.checkpointing.plan import (
        CheckpointingWarning,
        CheckpointPlan,
        LayerPlan,
        MoESelectiveWarning,
        planned_policy,
    )
    from remat.checkpointing.policy import (
        MODES,
        POLICY_KEYS,
        POLICY_STRINGS,
        CheckpointPolicy,
        LayerOverride,
        parse_policy,
    )
