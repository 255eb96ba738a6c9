"""The CUDA caching-allocator model: rounding, segments, splitting, reuse, merging, resizes; and its replay."""

from __future__ import annotations

import pytest

from remat.estimate.allocator import (
    LARGE_BUFFER,
    MIN_BLOCK_SIZE,
    SMALL_BUFFER,
    CachingAllocatorModel,
    round_request,
    segment_size,
)
from remat.estimate.replay import START_PHASE, replay
from remat.estimate.simulate import StorageEvent

MiB = 2**20


@pytest.mark.parametrize(("request_bytes", "rounded"), [(0, 0), (1, 512), (512, 512), (513, 1024), (5000, 5120)])
def test_requests_round_to_512_byte_blocks(request_bytes: int, rounded: int) -> None:
    assert round_request(request_bytes) == rounded


@pytest.mark.parametrize(("rounded", "segment"), [
    (512, SMALL_BUFFER), (MiB, SMALL_BUFFER), (MiB + 512, LARGE_BUFFER), (10 * MiB - 512, LARGE_BUFFER),
    (10 * MiB, 10 * MiB), (10 * MiB + 512, 12 * MiB), (25 * MiB, 26 * MiB),
])
def test_segment_sizes_follow_the_pools(rounded: int, segment: int) -> None:
    assert segment_size(rounded) == segment


def test_small_requests_share_one_small_segment() -> None:
    model = CachingAllocatorModel()
    for handle in range(3):
        model.malloc(handle, 1000)
    assert model.allocated == 3 * 1024
    assert (model.reserved, model.segments) == (SMALL_BUFFER, 1)


def test_zero_byte_tensors_take_no_block() -> None:
    model = CachingAllocatorModel()
    assert model.malloc(1, 0) == 0
    assert (model.allocated, model.reserved) == (0, 0)
    model.free(1)


def test_large_remainder_is_split_only_above_1mib() -> None:
    model = CachingAllocatorModel()
    # 10.5 MiB: a 12 MiB segment, 1.5 MiB left over -> split, the block is exactly the request
    assert model.malloc(1, 10 * MiB + MiB // 2) == 10 * MiB + MiB // 2
    # 11.5 MiB: a 12 MiB segment, 0.5 MiB left over -> not split: the whole 12 MiB counts as allocated
    assert model.malloc(2, 11 * MiB + MiB // 2) == 12 * MiB
    assert model.allocated == 22 * MiB + MiB // 2
    assert model.reserved == 24 * MiB


def test_freed_blocks_merge_and_are_reused_best_fit() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 4 * MiB)  # a 20 MiB segment: 4 MiB block + 16 MiB free remainder
    model.malloc(2, 3 * MiB)  # from the remainder
    assert model.reserved == LARGE_BUFFER
    model.free(1)
    model.free(2)  # both merge with the 13 MiB remainder: one free 20 MiB block
    # 19 MiB fits the merged block without a new segment; the 1 MiB left is not *more* than 1 MiB, so it is not split
    # off and the whole block counts as allocated
    assert model.malloc(3, 19 * MiB) == 20 * MiB
    assert model.reserved == LARGE_BUFFER


def test_best_fit_takes_the_smallest_free_block() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 12 * MiB)  # own segment of 12 MiB
    model.malloc(2, 30 * MiB)  # own segment of 30 MiB
    model.free(1)
    model.free(2)
    model.malloc(3, 11 * MiB)
    assert model.reserved == 42 * MiB  # no new segment
    assert model.live_bytes(3) == 12 * MiB  # the 12 MiB block, unsplit (taking the 30 MiB one would split it)
    model.malloc(4, 29 * MiB)
    assert (model.live_bytes(4), model.reserved) == (30 * MiB, 42 * MiB)


def test_peak_counts_blocks_not_bytes_and_frees_lower_allocated() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 100)
    model.malloc(2, 100)
    model.free(1)
    assert (model.allocated, model.peak_allocated) == (MIN_BLOCK_SIZE, 2 * MIN_BLOCK_SIZE)


def test_resize_holds_both_blocks_while_copying() -> None:
    model = CachingAllocatorModel()
    model.malloc(1, 4 * MiB)
    model.resize(1, 8 * MiB)
    assert model.peak_allocated == 12 * MiB
    assert model.allocated == 8 * MiB
    model.resize(1, 0)  # FSDP2 frees an unsharded parameter by resizing its storage to zero
    assert model.allocated == 0


def test_exact_kind_counts_bytes() -> None:
    model = CachingAllocatorModel("exact")
    model.malloc(1, 100)
    model.malloc(2, 11 * MiB + 7)
    assert (model.allocated, model.reserved) == (11 * MiB + 107, 0)


def test_unknown_kind_and_double_allocation_are_errors() -> None:
    with pytest.raises(ValueError, match="kind"):
        CachingAllocatorModel("tpu")  # type: ignore[arg-type]
    model = CachingAllocatorModel()
    model.malloc(1, 10)
    with pytest.raises(ValueError, match="already live"):
        model.malloc(1, 10)


def _events() -> tuple[list[StorageEvent], list[tuple[int, str]]]:
    events = [StorageEvent("alloc", 1, 100 * MiB, "parameters")]
    marks = [(1, "forward")]
    events += [StorageEvent("alloc", 2, 50 * MiB, "temporaries")]
    marks += [(2, "backward")]
    events += [StorageEvent("category", 2, 50 * MiB, "activations"), StorageEvent("free", 2, 50 * MiB, "activations")]
    marks += [(4, "optimizer step")]
    events += [StorageEvent("alloc", 3, 200 * MiB, "temporaries"),
               StorageEvent("category", 3, 200 * MiB, "optimizer_state")]
    return events, marks


def test_replay_first_step_peaks_when_the_optimizer_state_is_created() -> None:
    events, marks = _events()
    result = replay(events, marks, kind="exact", steady_state=False)
    assert result.peak_bytes == 300 * MiB
    assert result.phase == "optimizer step"
    assert result.breakdown["optimizer_state"] == 200 * MiB
    assert result.breakdown["parameters"] == 100 * MiB


def test_replay_steady_state_holds_the_optimizer_state_from_the_start() -> None:
    events, marks = _events()
    result = replay(events, marks, kind="exact", steady_state=True)
    assert result.peak_bytes == 350 * MiB
    assert result.phase == "forward"  # the activation is born in the forward phase
    assert result.phase_peaks == {"start": 300 * MiB, "forward": 350 * MiB, "backward": 350 * MiB,
                                  "optimizer step": 300 * MiB}
    assert result.breakdown == {"parameters": 100 * MiB, "buffers": 0, "gradients": 0,
                                "optimizer_state": 200 * MiB, "activations": 50 * MiB, "temporaries": 0,
                                "gradient_buckets": 0, "library_workspaces": 0}


def test_replay_of_baseline_only_is_the_start_phase() -> None:
    result = replay([StorageEvent("alloc", 1, 1000, "parameters")], [(1, "forward")], kind="cuda")
    assert (result.peak_bytes, result.phase) == (1024, START_PHASE)
    assert result.reserved_bytes == SMALL_BUFFER
