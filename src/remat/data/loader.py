"""`StatefulBatchIterator`: endless, resumable, per-rank batches over an in-memory dataset.

Each epoch visits the rows in an order drawn from (seed, epoch) alone, so the order never depends on how many batches
were taken before: a resumed run recomputes the same order and skips to where it stopped. A step's global batch is
`batch_size * world_size` consecutive rows of that order; rank r takes the r-th contiguous slice. The union over
ranks is therefore exactly the batch a single process with the global batch size would see.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import Dataset

from remat.errors import ConfigError

_STATE_VERSION = 1


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"remat-loader:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of `{name: [seq]}` examples into `{name: [batch, seq]}`."""
    return {name: torch.stack([item[name] for item in items]) for name in items[0]}


class StatefulBatchIterator(Iterator[dict[str, torch.Tensor]]):
    """Endless iterator of collated batches for one rank, reshuffled every epoch, with exact resume.

    `batch_size` is per rank. With `drop_last`, rows that do not fill a global batch at the end of an epoch are
    skipped (a different set each epoch when shuffling). Without it, the last global batch is smaller; when it does
    not split evenly across ranks it is topped up with the epoch's first rows so all ranks get the same batch size.
    """

    def __init__(
        self,
        dataset: Dataset[dict[str, torch.Tensor]],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(f"dataset must have a length; got {type(dataset).__name__}")
        if batch_size < 1:
            raise ConfigError(f"batch_size: must be at least 1; got {batch_size}")
        if world_size < 1:
            raise ConfigError(f"world_size: must be at least 1; got {world_size}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank: must be in [0, {world_size}) for world_size={world_size}; got {rank}")
        self.dataset = dataset
        self.num_rows = len(dataset)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.global_batch_size = batch_size * world_size
        if self.num_rows == 0 or (drop_last and self.num_rows < self.global_batch_size):
            raise ConfigError(
                f"the dataset has {self.num_rows} rows, fewer than one global batch of {self.global_batch_size} "
                f"(batch_size {batch_size} x world_size {world_size}); add data, lower the batch size or seq_length"
            )
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order: torch.Tensor | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Batches each rank gets per epoch (the same on every rank)."""
        full, rest = divmod(self.num_rows, self.global_batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None:
            if self.shuffle:
                generator = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
                self._order = torch.randperm(self.num_rows, generator=generator)
            else:
                self._order = torch.arange(self.num_rows)
        return self._order

    def _rank_indices(self, order: torch.Tensor, batch: int) -> torch.Tensor:
        start = batch * self.global_batch_size
        global_indices = order[start : start + self.global_batch_size]
        per_rank = -(-len(global_indices) // self.world_size)
        missing = per_rank * self.world_size - len(global_indices)
        if missing:
            global_indices = torch.cat([global_indices, order.repeat(-(-missing // len(order)))[:missing]])
        return global_indices[self.rank * per_rank : (self.rank + 1) * per_rank]

    def __iter__(self) -> StatefulBatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.batch_in_epoch >= self.batches_per_epoch:
            self.epoch += 1
            self.batch_in_epoch = 0
            self._order = None
        indices = self._rank_indices(self._epoch_order(), self.batch_in_epoch)
        self.batch_in_epoch += 1
        return collate([self.dataset[int(i)] for i in indices])

    def state_dict(self) -> dict[str, Any]:
        """Where the iterator stands, plus what must match for a resume to be exact."""
        return {
            "version": _STATE_VERSION,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": self.num_rows,
            "global_batch_size": self.global_batch_size,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state`; ConfigError if the data or batching differs from the run that saved it.

        The world size may change as long as the global batch size stays the same.
        """
        current = self.state_dict()
        for name in ("version", "seed", "shuffle", "num_rows", "global_batch_size", "drop_last"):
            if state.get(name) != current[name]:
                raise ConfigError(
                    f"cannot resume the data iterator: saved {name}={state.get(name)!r} but this run has "
                    f"{name}={current[name]!r}; the data, seed and global batch size must match the saved run"
                )
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        self._order = None
