"""A one-process checkpoint resumes on 2 ranks (gloo) with the same global batch: the data position is re-sharded, so
the run continues at the same global sample and its losses equal the one-process run's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from launches import run_torchrun
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
    # No metrics file, so rank 0 draws no report.png after rank 1 has left: with the report, 1 of 2 runs on a loaded
    # machine hung in ProcessGroupGloo's destructor at exit (after training had finished correctly).
    ddp["logging"]["metrics_file"] = None
    recipe_file = tmp_path / "ddp.yaml"
    recipe_file.write_text(yaml.safe_dump(ddp))
    proc = run_torchrun(["-m", "remat.cli", "finetune", str(recipe_file)])
    assert f"resumed from {step_2} at step 2" in proc.stdout
    assert ('resume: distributed.strategy: "single" -> "ddp" (compatible: same global batch; the data position is '
            "re-sharded to the same global sample)") in proc.stdout
    assert ("resume: data re-sharded from batches of 4 rows to 8 (local_batch_size 4 x 2 data-parallel ranks): "
            "continuing at row 16 of epoch 0, the same global sample") in proc.stdout
    resumed = [line.split(" | ") for line in proc.stdout.splitlines() if line.startswith("step ") and "| loss " in line]
    assert [fields[0] for fields in resumed] == ["step 3", "step 4"]
    # Same samples, same weights and moments; only the order of the gradient sums differs (DDP's all-reduce). The
    # log line rounds the loss to 4 decimals.
    torch.testing.assert_close(torch.tensor([float(fields[2].split()[1]) for fields in resumed]),
                               torch.tensor([r.loss for r in straight.records[2:]]), atol=6e-5, rtol=0)
    assert [int(fields[-1].split()[1]) for fields in resumed] == [r.num_label_tokens for r in straight.records[2:]]
