"""Saved training state (model, optimizer, schedule, data position, RNG), so that a run survives interruption.

Not activation checkpointing (that is `remat.checkpointing`). One interface, `TrainingStateStore` (``save`` /
``load``), with two implementations behind it: `SingleFileState` (``single`` and ``ddp``: one process writes the
whole state, `remat.training_state.single`) and `ShardedState` (``fsdp2``: every rank writes its shards with
torch.distributed.checkpoint, `remat.training_state.sharded`). Both follow the directory protocol of
`remat.training_state.layout` (``step_<N>`` directories, a completion marker, the ``latest`` pointer).
`state_store` picks the store for a run; `store_for_saved` the store that reads a saved directory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy): the file names of the protocol (`names`) load without torch.
_EXPORTS: dict[str, str] = {
    "TrainingStateStore": "remat.training_state.stores",
    "find_latest_checkpoint": "remat.training_state.layout",
}

__all__ = [
    "TrainingStateStore",
    "find_latest_checkpoint",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.training_state.layout import find_latest_checkpoint
    from remat.training_state.stores import TrainingStateStore
