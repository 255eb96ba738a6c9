"""A one-process checkpoint resumes on 2 ranks (gloo) with the same global batch: the data position is re-sharded, so
the run continues at the same global sample and its losses equal the one-process run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import run_torchrun
from dist_recipes import tiny_recipe

from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe

pytestmark = pytest.mark.distributed

CHECKPOINTS = {"checkpoint": {"enabled": True, "keep_last": None}}


def test_one_process_checkpoint_continues_on_two_ranks_at_the_same_sample(tmp_path: Path, remat_cache: Path) -> None:
    schedule = {"val_every_steps": None, "val_batches": None, "ckpt_every_steps": 2}
    # One process: local batch 4 x accumulation 2 = global 8, so each step draws 2 batches of 4 rows.
    single = tiny_recipe(tmp_path / "one", max_steps=4, step_scheduler=schedule, **CHECKPOINTS)
    del single["validation_dataset"]
    straight = FinetuneRecipe(validate_recipe(single)).run()
    assert [r.step for r in straight.records] == [1, 2, 3, 4]
    step_2 = tmp_path / "one" / "checkpoints" / "step_2"
    # Two ranks: local batch 4 x dp 2 x accumulation 1 = global 8, one batch of 8 rows per step.
    ddp = tiny_recipe(tmp_path / "two", strategy="ddp", max_steps=4, **CHECKPOINTS,
                      step_scheduler={**schedule, "local_batch_size": 4})
    del ddp["validation_dataset"]
    ddp["checkpoint"]["resume"] = str(step_2)
    recipe_file = tmp_path / "ddp.yaml"
    recipe_file.write_text(yaml.safe_dump(ddp))
    proc = run_torchrun(["-m", "remat.cli", "finetune", str(recipe_file)])
    assert f"resumed from {step_2} at step 2" in proc.stdout
    assert ('resume: distributed.strategy: "single" -> "ddp" (compatible: same global batch; the data position is '
            "re-sharded to the same global sample)") in proc.stdout
    assert ("resume: data re-sharded from batches of 4 rows to 8 (local_batch_size 4 x 2 data-parallel ranks): "
            "continuing at row 16 of epoch 0, the same global sample") in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    resumed = [row for row in rows if row["kind"] == "train"]
    assert [row["step"] for row in resumed] == [3, 4]
    # Same samples, same weights and moments; only the order of the gradient sums differs (DDP's all-reduce).
    torch.testing.assert_close(torch.tensor([row["loss"] for row in resumed]),
                               torch.tensor([r.loss for r in straight.records[2:]]), atol=1e-5, rtol=0)
    assert [row["num_label_tokens"] for row in resumed] == [r.num_label_tokens for r in straight.records[2:]]
