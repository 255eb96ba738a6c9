"""Attention FLOPs of grouped-query attention (fewer key/value heads than query heads) are counted on every supported
torch: torch's own counters before 2.13 refuse such shapes, so the planner gives them the query's head count."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from remat.planner.measure import FLOP_FORMULAS, _attention_backward_flops, _attention_flops


def test_grouped_query_attention_counts_the_work_of_every_query_head() -> None:
    query, grouped, repeated = (2, 8, 64, 16), (2, 2, 64, 16), (2, 8, 64, 16)
    assert _attention_flops(query, grouped, grouped) == sdpa_flop_count(query, repeated, repeated) > 0
    assert (_attention_backward_flops(query, query, grouped, grouped)
            == sdpa_backward_flop_count(query, query, repeated, repeated) > 0)


def test_every_attention_kernel_the_estimate_models_has_the_grouped_query_formula() -> None:
    aten = torch.ops.aten
    for kernel in (aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention,
                   aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_cudnn_attention):
        assert FLOP_FORMULAS[kernel] is _attention_flops
        assert FLOP_FORMULAS[getattr(aten, f"{kernel.__name__}_backward")] is _attention_backward_flops
