"""Attention FLOPs of grouped-query attention (fewer key/value heads than query heads) are counted on every supported
torch: torch's own counters before 2.13 refuse such shapes, so the planner gives them the query's head count."""

from __future__ import annotations

from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from remat.planner.measure import _cpu_attention_backward_flops, _cpu_attention_flops


def test_grouped_query_attention_counts_the_work_of_every_query_head() -> None:
    query, grouped, repeated = (2, 8, 64, 16), (2, 2, 64, 16), (2, 8, 64, 16)
    assert _cpu_attention_flops(query, grouped, grouped) == sdpa_flop_count(query, repeated, repeated) > 0
    assert (_cpu_attention_backward_flops(query, query, grouped, grouped)
            == sdpa_backward_flop_count(query, query, repeated, repeated) > 0)
