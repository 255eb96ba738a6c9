"""The planner composes the steps of per-block mixes instead of simulating each one (`remat.estimate.compose`): counted,
not timed, on a packed bfloat16 recipe with document-wise attention and the fused loss (the seed recipe's kind).
NOTE [ The whole step composed from is the one that checkpoints nothing ] in `remat.planner.planner`."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import yaml

import remat.planner.planner as planner_module
from remat.cli import main

RECIPE = {
    "model": {"preset": "tiny-llama", "dtype": "bfloat16", "document_attention": True},
    "tokenizer": {"vocab_size": 512},
    "dataset": {"seq_length": 256, "packing": True},
    "step_scheduler": {"global_batch_size": 2, "local_batch_size": 2, "max_steps": 2},
    "loss_fn": {"_target_": "remat.loss.FusedLinearCrossEntropy"},
    "distributed": {"strategy": "single", "device": "cpu", "activation_checkpointing": "none"},
}


def test_a_four_budget_plan_of_a_packed_bf16_recipe_simulates_one_whole_step_and_composes_every_mix(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = tmp_path / "seed_like.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "output_dir": str(tmp_path / "run")}))
    counts: collections.Counter[str] = collections.Counter()
    simulate, compose = planner_module.simulate_step, planner_module.compose

    def counted_simulate(*args: Any, stop_at_update: bool = False, **kwargs: Any) -> Any:
        counts["partial" if stop_at_update else "whole"] += 1
        return simulate(*args, stop_at_update=stop_at_update, **kwargs)

    def counted_compose(*args: Any) -> Any:
        trace = compose(*args)
        counts["composed" if trace is not None else "not composed"] += 1
        return trace

    monkeypatch.setattr(planner_module, "simulate_step", counted_simulate)
    monkeypatch.setattr(planner_module, "compose", counted_compose)
    assert main(["plan", str(recipe), "--budget", "40MiB", "--budget", "37MiB", "--budget", "34MiB",
                 "--budget", "31MiB"]) == 0
    # One whole step (none); each uniform policy stopped at the update and composed; every mix composed.
    uniforms = 5  # full, selective, attention, mlp, every 2nd block: the policies no earlier trace has
    assert counts["whole"] == 1, counts
    assert counts["partial"] <= uniforms, counts
    assert counts["composed"] >= counts["partial"] + 4, counts  # the four budgets' mixes were composed
