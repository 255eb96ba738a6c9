"""``distributed.activation_checkpointing: auto`` on 2 CPU ranks (gloo, torchrun): the memory budget is per rank.
Under torchrun every rank resolves ``auto`` itself before training (world size from the environment); the planner
is deterministic, so every rank logs the same plan, and the tracked peak of every rank (the run's ``mem_bytes`` is
the maximum over the ranks) stays within the budget while using the room it gives (above full checkpointing)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny import tiny_recipe

from remat.checkpointing import CheckpointPolicy
from remat.recipes.loader import load_recipe

SMALL = {"preset": "tiny-llama", "config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}}


def _recipe(tmp_path: Path, strategy: str) -> Path:
    """``strategy`` is ddp, fsdp2, or fsdp2-lora (LoRA adapters of rank 4 under FSDP2: the frozen base sharded)."""
    path = tmp_path / "auto.yaml"
    recipe = tiny_recipe(
        output_dir=str(tmp_path / "run"), model=SMALL, dataset={"seq_length": 128}, step_scheduler={"max_steps": 2},
        checkpoint={"enabled": False}, logging={"metrics_file": "m.jsonl", "memory": "tracked"},
        distributed={"strategy": strategy.removesuffix("-lora"), "activation_checkpointing": "auto"})
    if strategy.endswith("-lora"):
        recipe["peft"] = {"r": 4}
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp2-lora"])
def test_every_rank_plans_the_same_and_stays_within_the_per_rank_budget(tmp_path: Path, remat_cache: Path,
                                                                         strategy: str) -> None:
    from remat.planner.api import planner_for_recipe

    path = _recipe(tmp_path, strategy)
    planner = planner_for_recipe(load_recipe(path), world_size=2)
    none, full = (planner.estimate(CheckpointPolicy(mode=mode)).peak_bytes for mode in ("none", "full"))
    budget = full + (none - full) // 3
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "remat.cli", "--log-level", "INFO", "finetune", str(path), "--distributed.activation_checkpointing.memory_budget", str(budget)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=dict(os.environ))
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    # under torchrun alone each rank plans, or reads the plan rank 0 wrote if it comes later: the same plan
    plans = re.findall(r"activation checkpointing 'auto' (?:planned for|read from) [^\n]*?: ([^\n]+)", output)
    assert len(plans) == 2 and plans[0] == plans[1], plans
    records = [json.loads(line) for line in (tmp_path / "run" / "m.jsonl").read_text().splitlines()]
    steps = [r["mem_bytes"] for r in records if "mem_bytes" in r]
    # every step within the budget; the second (the optimizer state exists) above what full checkpointing needs
    assert len(steps) == 2 and all(peak <= budget for peak in steps) and steps[1] > full, (steps, full, budget)
