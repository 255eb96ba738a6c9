"""Activation checkpointing: policies (what to recompute), discovery (where the blocks are), and wrapping.

Start with `apply_activation_checkpointing(model, policy)`; it returns a `CheckpointPlan` saying what each block got.
"""

from __future__ import annotations

from remat.checkpointing.apply import apply_activation_checkpointing, is_checkpointed, remove_activation_checkpointing
from remat.checkpointing.discovery import (
    Block,
    BlockSearch,
    find_attention,
    find_blocks,
    find_decoder,
    find_mlp,
    is_moe_block,
    kv_sharing_role,
)
from remat.checkpointing.plan import CheckpointingWarning, CheckpointPlan, LayerPlan
from remat.checkpointing.policy import (
    MODES,
    POLICY_KEYS,
    POLICY_STRINGS,
    CheckpointPolicy,
    LayerOverride,
    parse_policy,
)

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
    "apply_activation_checkpointing",
    "find_attention",
    "find_blocks",
    "find_decoder",
    "find_mlp",
    "is_checkpointed",
    "is_moe_block",
    "kv_sharing_role",
    "parse_policy",
    "remove_activation_checkpointing",
]
