"""Exact byte counts of LiveTensorTracker on hand-made ops: allocation, frees, views, in-place ops, marks."""

from __future__ import annotations

import pytest
import torch

from remat.memory import LiveTensorTracker
from remat.memory.tracker import CATEGORIES

F32 = 4


def test_three_tensors_free_one_exact_peak_and_current() -> None:
    with LiveTensorTracker() as tracker:
        a = torch.empty(1000)
        b = torch.empty(500)
        c = torch.empty(250)
        del b
        d = torch.empty(100)
    assert tracker.peak_bytes == (1000 + 500 + 250) * F32
    assert tracker.current_bytes == (1000 + 250 + 100) * F32
    assert tracker.peak_op == "aten.empty.memory_format"
    assert tracker.peak_breakdown == {**dict.fromkeys(CATEGORIES, 0), "temporaries": 7000}
    del a, c, d


def test_views_and_inplace_ops_are_not_double_counted() -> None:
    with LiveTensorTracker() as tracker:
        a = torch.zeros(10, 100)
        a.add_(1.0)
        view = a.view(100, 10).t()
        halves = a.split(5)
        a.mul_(view.t().reshape(10, 100))
        detached = a.detach()
    assert tracker.current_bytes == 1000 * F32
    assert tracker.peak_bytes == 1000 * F32
    del view, halves, detached, a


def test_views_of_tensors_from_before_entry_add_nothing() -> None:
    outside = torch.ones(256)
    with LiveTensorTracker() as tracker:
        outside.mul_(2.0)
        chunks = outside.unsafe_chunk(4)
        _ = outside[::2]
    assert tracker.peak_bytes == 0
    del chunks


def test_freed_storage_is_subtracted_only_when_its_last_view_dies() -> None:
    with LiveTensorTracker() as tracker:
        a = torch.empty(300)
        view = a[:10]
        del a
        tracker.mark("view_alive")
        del view
        tracker.mark("all_freed")
    assert tracker.marks == {"view_alive": 1200, "all_freed": 0}


def test_multi_output_op_counts_each_fresh_storage() -> None:
    x = torch.randn(8, 16)
    with LiveTensorTracker() as tracker:
        values, indices = torch.max(x, dim=1)
    assert tracker.current_bytes == 8 * F32 + 8 * 8  # float32 values, int64 indices
    del values, indices


def test_tensors_built_from_python_data_are_counted() -> None:
    with LiveTensorTracker() as tracker:
        t = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    assert tracker.current_bytes == 3 * 8
    del t


def test_tensor_resize_and_storage_resize_are_followed() -> None:
    with LiveTensorTracker() as tracker:
        t = torch.empty(10)
        t.resize_(100)
        tracker.mark("tensor_resized")
        t.untyped_storage().resize_(0)
        tracker.mark("storage_freed")
        t.untyped_storage().resize_(800)
    assert tracker.marks == {"tensor_resized": 400, "storage_freed": 0}
    assert tracker.current_bytes == 800
    assert tracker.peak_bytes == 800
    assert torch.UntypedStorage.resize_.__name__ == "resize_"  # the wrapper is removed on exit
    del t


def test_a_storage_emptied_before_the_tracker_counts_when_it_grows_back() -> None:
    """FSDP2 keeps an unsharded parameter's storage for the run, emptied between steps: the next step's tracker
    never saw it allocated, and its growth back is that step's allocation (freed again by the next resize)."""
    kept = torch.empty(100)
    kept.untyped_storage().resize_(0)  # an earlier step's, emptied after use
    with LiveTensorTracker() as tracker:
        kept.untyped_storage().resize_(400)
        tracker.mark("grown")
        kept.untyped_storage().resize_(0)
        tracker.mark("emptied")
    assert tracker.marks == {"grown": 400, "emptied": 0}
    assert tracker.peak_bytes == 400 and tracker.peak_op == "UntypedStorage.resize_"
    del kept


def test_mark_labels_the_phase_of_a_later_peak_and_reset_peak_restarts() -> None:
    with LiveTensorTracker() as tracker:
        big = torch.empty(1000)
        tracker.mark("after_big")
        del big
        small = torch.empty(10)
        tracker.reset_peak()
        assert tracker.peak_bytes == 40
        tracker.mark("second")
        other = torch.empty(20)
    assert tracker.peak_bytes == 120
    assert tracker.peak_phase == "second"
    assert tracker.marks == {"after_big": 4000, "second": 40}
    del small, other


def test_peak_phase_is_the_op_when_no_mark_precedes_and_entry_when_nothing_grew() -> None:
    with LiveTensorTracker() as tracker:
        x = torch.ones(4) + 1
    assert tracker.peak_phase == "aten.add.Tensor"
    with LiveTensorTracker() as idle:
        pass
    assert idle.peak_phase == "entry"
    assert idle.peak_bytes == 0
    del x


def test_figures_freeze_at_exit_and_reentry_starts_fresh() -> None:
    tracker = LiveTensorTracker()
    with tracker:
        kept = torch.empty(50)
    del kept
    assert tracker.current_bytes == 200
    with tracker:
        other = torch.empty(5)
    assert (tracker.current_bytes, tracker.peak_bytes) == (20, 20)
    del other


def test_nested_distinct_trackers_both_count_and_reentering_one_raises() -> None:
    with LiveTensorTracker() as outer:
        a = torch.empty(100)
        with LiveTensorTracker() as inner:
            b = torch.empty(10)
            with pytest.raises(RuntimeError, match="already active"):
                inner.__enter__()
    assert (outer.current_bytes, inner.current_bytes) == (440, 40)
    del a, b


def test_module_baseline_counts_parameters_buffers_and_existing_grads() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    model[0].weight.grad = torch.zeros_like(model[0].weight)
    with LiveTensorTracker(module=model) as tracker:
        pass
    params = (8 * 4 + 4 + 4 + 4) * F32
    buffers = (4 + 4) * F32 + 8  # running mean/var float32, num_batches_tracked int64
    assert tracker.peak_breakdown == {
        **dict.fromkeys(CATEGORIES, 0),
        "parameters": params,
        "buffers": buffers,
        "gradients": 8 * 4 * F32,
    }
    assert tracker.peak_bytes == params + buffers + 8 * 4 * F32


def test_tied_parameters_share_one_storage_and_count_once() -> None:
    embed = torch.nn.Embedding(16, 8)
    head = torch.nn.Linear(8, 16, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleList([embed, head])
    with LiveTensorTracker(module=model) as tracker:
        pass
    assert tracker.current_bytes == 16 * 8 * F32


def test_higher_order_operator_outputs_are_counted_as_one_op() -> None:
    x = torch.randn(100)
    with LiveTensorTracker() as tracker:
        y = torch.cond(x.sum() > 0, lambda t: t.sin() * 2, lambda t: t.cos(), (x,))
    assert tracker.current_bytes == 100 * F32
    assert tracker.peak_bytes == 100 * F32 + 1  # the output and the bool predicate, alive together
    assert tracker.peak_op == "cond"
    del y


def test_host_allocations_count_apart_from_device_bytes() -> None:
    with LiveTensorTracker() as tracker:
        device = torch.ones(1000)  # 4,000 bytes
        with tracker.host_allocations():
            host = torch.empty(2000)  # 8,000 bytes
            host[:1000].copy_(device)  # an in-place op on a host storage changes nothing
            extra = torch.empty(500)
        assert (tracker.current_bytes, tracker.host_bytes) == (4000, 10000)
        del extra
        restored = host.clone()  # outside the block: device memory again
        assert (tracker.current_bytes, tracker.host_bytes) == (12000, 8000)
        del host, restored
        assert (tracker.current_bytes, tracker.host_bytes) == (4000, 0)
    assert (tracker.peak_bytes, tracker.host_peak_bytes) == (12000, 10000)
    assert sum(tracker.peak_breakdown.values()) == tracker.peak_bytes
    del device


def test_host_rounding_counts_what_the_host_allocator_takes() -> None:
    from remat.memory.tracker import pinned_block_bytes

    assert [pinned_block_bytes(n) for n in (0, 1, 3000, 4096, 4097)] == [0, 1, 4096, 4096, 8192]
    with LiveTensorTracker(host_rounding=pinned_block_bytes) as tracker:
        with tracker.host_allocations():
            host = torch.empty(750)  # 3,000 bytes, a 4,096-byte pinned block
        assert tracker.host_bytes == 4096
        del host
    assert (tracker.host_bytes, tracker.host_peak_bytes, tracker.peak_bytes) == (0, 4096, 0)
