"""The planner's answers are the same as before the planner core was rebuilt (#21): a small recipe planned at four
budgets, every field of every plan (block modes, predicted peaks, FLOPs, candidates) but the seconds and the
recompute costs (FLOP-equivalents, added later: without calibrated per-class rates they equal the FLOPs), equal to the
plans main gave at 55e1df3 (``data/plans_before_21.json``, written by this module's `plans` run in that tree).
Candidates are now priced as copies of one validated recipe; a change in what they cost shows up here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from remat.checkpointing import CheckpointPolicy
from remat.planner.api import planner_for_recipe
from remat.recipes.loader import validate_recipe

BEFORE = Path(__file__).resolve().parent / "data" / "plans_before_21.json"
SMALL = {"preset": "tiny-llama", "config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}}
RECIPE = {"model": SMALL, "tokenizer": {"vocab_size": 512}, "dataset": {"seq_length": 256},
          "step_scheduler": {"global_batch_size": 2, "local_batch_size": 2}, "distributed": {"device": "cpu"}}


def plans() -> list[Any]:
    planner = planner_for_recipe(validate_recipe(RECIPE), target="cpu")
    none, full = (planner.estimate(CheckpointPolicy(mode=m)).peak_bytes for m in ("none", "full"))
    return [_without_seconds(json.loads(planner.plan(full + int(share * (none - full)), all_candidates=True).to_json()))
            for share in (1.0, 0.66, 0.33, 0.1)]


def _without_seconds(value: Any) -> Any:
    if isinstance(value, dict):
        if "recompute_cost" in value:  # without per-class rates the cost is the FLOPs (the plans below have none)
            assert value["recompute_cost"] == value["recompute_flops"], value
        return {k: _without_seconds(v) for k, v in value.items() if "second" not in k and k != "recompute_cost"}
    if isinstance(value, list):
        return [_without_seconds(v) for v in value]
    return value


def test_plans_equal_those_before_the_planner_core_was_rebuilt() -> None:
    assert plans() == json.loads(BEFORE.read_text())
