"""The stores behind one interface, `TrainingStateStore` (``save`` / ``load``): `SingleFileState` (``single`` and
``ddp``: one process writes the whole state, `remat.training_state.single`) and `ShardedState` (``fsdp2``: every
rank writes its shards with torch.distributed.checkpoint, `remat.training_state.sharded`). `state_store` picks the
store for a run; `store_for_saved` the store that reads a saved directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from torch import nn

from remat.distributed import DistributedSetup
from remat.errors import ConfigError
from remat.training_state.layout import (
    LAYOUT_SHARDED,
    checkpoint_layout,
    checkpoint_name,
)
from remat.training_state.sharded import load_sharded_checkpoint, save_sharded_checkpoint
from remat.training_state.single import load_checkpoint, save_checkpoint



class TrainingStateStore(Protocol):
    """Saves and loads a run's training state; called on every rank together."""

    def save(self, root: Path, step: int, *, model: nn.Module, optimizer: Any, lr_scheduler: Any,
             train_state: dict[str, Any], tokenizer: Any, keep_last: int | None) -> Path:
        """Write ``step_<step>`` under ``root`` atomically; return its path."""
        ...

    def load(self, path: Path, *, model: nn.Module, optimizer: Any, lr_scheduler: Any,
             verify: bool = True) -> dict[str, Any]:
        """Restore the states in place from ``path`` (a ``step_<N>`` directory or a root); return the train state.
        `verify`: check every file's SHA-256 first (False when the caller already did)."""
        ...


class SingleFileState:
    """The whole state written by one process (rank 0 under ddp; the others wait for it)."""

    def __init__(self, setup: DistributedSetup) -> None:
        self.setup = setup

    def save(self, root: Path, step: int, **states: Any) -> Path:
        """See `TrainingStateStore.save`."""
        path = root / checkpoint_name(step)
        if self.setup.is_main_process:
            path = save_checkpoint(root, step, **states)
        self.setup.barrier()
        return path

    def load(self, path: Path, **states: Any) -> dict[str, Any]:
        """See `TrainingStateStore.load`."""
        return load_checkpoint(path, **states)


class ShardedState:
    """Every rank writes and reads its own shards (torch.distributed.checkpoint), resharded on load."""

    def save(self, root: Path, step: int, **states: Any) -> Path:
        """See `TrainingStateStore.save`."""
        return save_sharded_checkpoint(root, step, **states)

    def load(self, path: Path, **states: Any) -> dict[str, Any]:
        """See `TrainingStateStore.load`."""
        return load_sharded_checkpoint(path, **states)


def state_store(setup: DistributedSetup) -> TrainingStateStore:
    """The store a run with ``setup`` saves with: sharded for fsdp2, single-file otherwise."""
    return ShardedState() if setup.strategy == "fsdp2" else SingleFileState(setup)


def store_for_saved(path: Path, setup: DistributedSetup) -> TrainingStateStore:
    """The store that reads the saved state at ``path`` into a run with ``setup``; ConfigError naming
    ``checkpoint.resume`` when that run cannot resume it."""
    if checkpoint_layout(path) == LAYOUT_SHARDED:
        return ShardedState()
    if setup.strategy == "fsdp2":
        raise ConfigError(
            f"checkpoint.resume: {path} was written by a single-process or ddp run, which fsdp2 cannot resume; "
            "allowed: resume it with distributed.strategy ddp or single, or start from its model/ export as "
            "model.pretrained_model_name_or_path"
        )
    return SingleFileState(setup)
