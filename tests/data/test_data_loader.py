"""StatefulBatchIterator: determinism, epochs, exact resume, per-rank shards."""

from __future__ import annotations

import itertools

import pytest
import torch

from remat.data.dataset import TokenizedDataset
from remat.data.loader import StatefulBatchIterator
from remat.errors import ConfigError


def numbered_dataset(rows: int, seq: int = 3) -> TokenizedDataset:
    """Row i holds the value i everywhere, so a batch shows which rows it took."""
    values = torch.arange(rows).unsqueeze(1).expand(rows, seq).contiguous()
    return TokenizedDataset(
        {"input_ids": values, "labels": values.clone(), "position_ids": values.clone()}, format="text", packed=True
    )


def row_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


def take(iterator: StatefulBatchIterator, count: int) -> list[list[int]]:
    return [row_ids(batch) for batch in itertools.islice(iterator, count)]


def test_batches_are_collated_and_deterministic() -> None:
    ds = numbered_dataset(10)
    batch = next(StatefulBatchIterator(ds, 4, seed=3))
    assert {name: tuple(t.shape) for name, t in batch.items()} == {
        "input_ids": (4, 3),
        "labels": (4, 3),
        "position_ids": (4, 3),
    }
    assert take(StatefulBatchIterator(ds, 4, seed=3), 7) == take(StatefulBatchIterator(ds, 4, seed=3), 7)
    assert take(StatefulBatchIterator(ds, 4, seed=3), 7) != take(StatefulBatchIterator(ds, 4, seed=4), 7)


def test_epochs_cover_every_row_once_and_reshuffle() -> None:
    it = StatefulBatchIterator(numbered_dataset(12), 4, seed=0)
    assert it.batches_per_epoch == 3
    epochs = [list(itertools.chain.from_iterable(take(it, 3))) for _ in range(3)]
    assert it.epoch == 2
    assert all(sorted(order) == list(range(12)) for order in epochs)
    assert len({tuple(order) for order in epochs}) == 3


def test_without_shuffle_rows_come_in_order_and_drop_last_skips_the_tail() -> None:
    it = StatefulBatchIterator(numbered_dataset(7), 3, shuffle=False)
    assert take(it, 4) == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]
    assert it.epoch == 1


def test_keep_last_gives_a_smaller_final_batch() -> None:
    it = StatefulBatchIterator(numbered_dataset(7), 3, shuffle=False, drop_last=False)
    assert it.batches_per_epoch == 3
    assert take(it, 4) == [[0, 1, 2], [3, 4, 5], [6], [0, 1, 2]]


def test_resume_yields_exactly_the_uninterrupted_batches() -> None:
    ds = numbered_dataset(10)
    uninterrupted = take(StatefulBatchIterator(ds, 3, seed=7), 12)  # 3 batches per epoch: crosses 3 epoch ends
    for stop in (1, 3, 5, 9):
        first = StatefulBatchIterator(ds, 3, seed=7)
        before = take(first, stop)
        resumed = StatefulBatchIterator(ds, 3, seed=7)
        resumed.load_state_dict(first.state_dict())
        assert before + take(resumed, 12 - stop) == uninterrupted
        assert resumed.epoch == 3


def test_state_survives_torch_save(tmp_path) -> None:
    first = StatefulBatchIterator(numbered_dataset(10), 2, seed=1)
    take(first, 6)
    torch.save(first.state_dict(), tmp_path / "data.pt")
    resumed = StatefulBatchIterator(numbered_dataset(10), 2, seed=1)
    resumed.load_state_dict(torch.load(tmp_path / "data.pt"))
    assert take(resumed, 4) == take(first, 4)


def test_ranks_get_disjoint_shards_that_make_up_the_global_batch() -> None:
    ds = numbered_dataset(20)
    single = take(StatefulBatchIterator(ds, 6, seed=5), 6)
    ranks = [take(StatefulBatchIterator(ds, 2, seed=5, rank=r, world_size=3), 6) for r in range(3)]
    for step in range(6):
        shards = [ranks[r][step] for r in range(3)]
        assert all(len(shard) == 2 for shard in shards)
        assert (
            not set(shards[0]) & set(shards[1])
            and not set(shards[1]) & set(shards[2])
            and not set(shards[0]) & set(shards[2])
        )
        assert shards[0] + shards[1] + shards[2] == single[step]


def test_ranks_get_equal_batches_when_the_last_one_does_not_split_evenly() -> None:
    ds = numbered_dataset(5)
    ranks = [StatefulBatchIterator(ds, 2, shuffle=False, rank=r, world_size=2, drop_last=False) for r in range(2)]
    assert [it.batches_per_epoch for it in ranks] == [2, 2]
    assert [take(it, 2) for it in ranks] == [[[0, 1], [4]], [[2, 3], [0]]]  # the odd row is topped up with row 0


def test_resume_with_another_world_size_but_the_same_global_batch() -> None:
    ds = numbered_dataset(16)
    single = StatefulBatchIterator(ds, 4, seed=2)
    take(single, 5)
    expected = take(StatefulBatchIterator(ds, 4, seed=2), 9)[5:]
    halves = []
    for rank in range(2):
        it = StatefulBatchIterator(ds, 2, seed=2, rank=rank, world_size=2)
        it.load_state_dict(single.state_dict())
        halves.append(take(it, 4))
    assert [a + b for a, b in zip(*halves, strict=False)] == expected


def test_mismatched_resume_state_is_refused() -> None:
    state = StatefulBatchIterator(numbered_dataset(10), 2, seed=1).state_dict()
    with pytest.raises(ConfigError, match=r"saved num_rows=10 but this run has num_rows=11"):
        StatefulBatchIterator(numbered_dataset(11), 2, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"saved global_batch_size=2 but this run has global_batch_size=4"):
        StatefulBatchIterator(numbered_dataset(10), 2, seed=1, world_size=2).load_state_dict(state)


def test_too_few_rows_and_bad_arguments_are_named() -> None:
    with pytest.raises(
        ConfigError, match=r"the dataset has 5 rows, fewer than one global batch of 6 \(batch_size 3 x world_size 2\)"
    ):
        StatefulBatchIterator(numbered_dataset(5), 3, world_size=2)
    assert StatefulBatchIterator(numbered_dataset(5), 3, world_size=2, drop_last=False).batches_per_epoch == 1
    with pytest.raises(ConfigError, match=r"rank: must be in \[0, 2\) for world_size=2; got 2"):
        StatefulBatchIterator(numbered_dataset(8), 2, rank=2, world_size=2)
    with pytest.raises(ConfigError, match=r"batch_size: must be at least 1; got 0"):
        StatefulBatchIterator(numbered_dataset(8), 0)
