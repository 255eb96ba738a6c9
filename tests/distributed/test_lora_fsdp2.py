"""LoRA under FSDP2 (NeMo's PEFT recipes' layout): a 2-rank run that crashes after a checkpoint resumes and continues
the same loss curve; its sharded checkpoint holds the adapters and their optimizer state only (the frozen base is the
pretrained model the run is built from again); its ``adapter/`` and merged ``model/`` exports equal what a
single-process run of the same recipe writes with peft's own merge (`remat.training_state.peft_merge`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_worker import lora_recipe
from launches import run_worker
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory, remat_cache: Path) -> tuple[list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("lora")
    return run_worker("lora", out), out


def test_a_crashed_lora_run_resumes_and_continues_the_same_curve(lora_run: tuple[list[dict[str, Any]], Path]) -> None:
    reports, out = lora_run
    for report in reports:
        assert Path(report["resumed_from"]) == out / "crashed" / "checkpoints" / "step_2"
        assert report["resumed"]["steps"] == [3, 4]
        assert report["resumed"]["loss"] == report["straight"]["loss"][2:]
        assert report["resumed"]["grad_norm"] == report["straight"]["grad_norm"][2:]


def test_the_sharded_checkpoint_holds_the_adapters_and_their_optimizer_state_only(
        lora_run: tuple[list[dict[str, Any]], Path]) -> None:
    _, out = lora_run
    step_4 = out / "straight" / "checkpoints" / "step_4"
    assert json.loads((step_4 / "COMPLETE.json").read_text())["peft"] is True
    saved = FileSystemReader(step_4 / "dcp").read_metadata().state_dict_metadata
    model_keys = [key for key in saved if key.startswith("model.")]
    assert model_keys and all(".lora_A." in key or ".lora_B." in key for key in model_keys), model_keys[:5]
    assert any(key.startswith("optimizer.state.") for key in saved)


def test_the_exports_equal_a_single_process_run_s(lora_run: tuple[list[dict[str, Any]], Path],
                                                  tmp_path: Path) -> None:
    reports, out = lora_run
    job = FinetuneRecipe(validate_recipe(lora_recipe(tmp_path / "single", strategy="single")))
    result = job.run()
    torch.testing.assert_close(torch.tensor([r.loss for r in result.records]),
                               torch.tensor(reports[0]["straight"]["loss"]), atol=1e-5, rtol=0)
    sharded, single = out / "straight" / "checkpoints" / "step_4", tmp_path / "single" / "checkpoints" / "step_4"
    for folder, file in (("model", "model.safetensors"), ("adapter", "adapter_model.safetensors")):
        mine, theirs = load_file(sharded / folder / file), load_file(single / folder / file)
        assert set(mine) == set(theirs), (folder, sorted(set(mine) ^ set(theirs))[:5])
        for name, tensor in theirs.items():
            torch.testing.assert_close(mine[name], tensor, atol=1e-5, rtol=1e-4, msg=f"{folder}: {name}")


def test_qlora_under_fsdp2_trains_the_single_process_losses_and_exports_the_same_float_model(
        tmp_path_factory: pytest.TempPathFactory, remat_cache: Path, tmp_path: Path) -> None:
    """The 4-bit packed weights are sharded like any parameter and gathered with their layer's quantisation
    constants (NOTE [ QLoRA in remat ]): 2 ranks train one process's losses; both exports are the same float model."""
    pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes (the test extra installs it)")
    from dist_worker import qlora_recipe
    from tiny import tiny_causal_lm

    out = tmp_path_factory.mktemp("qlora")
    tiny_causal_lm(vocab_size=512).save_pretrained(out / "base")
    reports = run_worker("qlora", out)
    job = FinetuneRecipe(validate_recipe(qlora_recipe(tmp_path / "single", out / "base", strategy="single")))
    single = [r.loss for r in job.run().records]
    for report in reports:
        torch.testing.assert_close(torch.tensor(report["loss"]), torch.tensor(single), atol=1e-5, rtol=0)
    sharded = load_file(out / "run" / "checkpoints" / "step_3" / "model" / "model.safetensors")
    theirs = load_file(tmp_path / "single" / "checkpoints" / "step_3" / "model" / "model.safetensors")
    assert set(sharded) == set(theirs) and all(tensor.is_floating_point() for tensor in sharded.values())
    for name, tensor in theirs.items():
        torch.testing.assert_close(sharded[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
