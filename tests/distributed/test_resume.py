"""Distributed checkpoints: a 2-rank run that crashes after a checkpoint resumes and continues the same loss curve
(FSDP2: sharded, torch.distributed.checkpoint; DDP: rank 0 writes the single-process format); an FSDP2 checkpoint
resumes in one process (DCP reshards 2 -> 1), and its model/ export loads in transformers with the same weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from launches import run_worker
from dist_recipes import tiny_recipe
from transformers import AutoModelForCausalLM

from remat.training_state.layout import checkpoint_layout, list_checkpoints
from remat.training_state.sharded import load_sharded_checkpoint
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def resume_run(tmp_path_factory: pytest.TempPathFactory, remat_cache: Path) -> tuple[list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("resume")
    return run_worker("resume", out), out


@pytest.mark.parametrize(("strategy", "layout"), [("fsdp2", "sharded"), ("ddp", "single")])
def test_crashed_run_resumes_and_continues_the_same_curve(strategy: str, layout: str,
                                                          resume_run: tuple[list[dict[str, Any]], Path]) -> None:
    reports, out = resume_run
    for report in reports:
        run = report[strategy]
        assert run["straight"]["steps"] == [1, 2, 3, 4, 5, 6]
        assert Path(run["resumed_from"]) == out / f"{strategy}-crashed" / "checkpoints" / "step_4"
        assert run["resumed"]["steps"] == [5, 6]
        # Same ranks, same shards: the restored weights, optimizer state, schedule and data position are exact.
        assert run["resumed"]["loss"] == run["straight"]["loss"][4:]
        assert run["resumed"]["grad_norm"] == run["straight"]["grad_norm"][4:]
        assert run["resumed"]["validation"] == [[6, run["straight"]["validation"][1][1]]]
    metrics = [json.loads(line) for line in (out / f"{strategy}-crashed" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in metrics if row["kind"] == "train"]
    # Only rank 0 writes metrics: steps 1-5 of the crashed run, then 5-6 of the resumed one.
    assert [row["step"] for row in train_rows] == [1, 2, 3, 4, 5, 5, 6]
    assert [row["loss"] for row in train_rows[:4]] == reports[0][strategy]["straight"]["loss"][:4]
    checkpoints = list_checkpoints(out / f"{strategy}-crashed" / "checkpoints")
    assert [p.name for p in checkpoints] == ["step_2", "step_4", "step_6"]
    assert {checkpoint_layout(p) for p in checkpoints} == {layout}
    if layout == "sharded":
        assert sorted(p.name for p in (checkpoints[-1] / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert sorted(p.name for p in (checkpoints[-1] / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]


def test_fsdp2_checkpoint_resumes_in_one_process(tmp_path: Path, remat_cache: Path,
                                                 resume_run: tuple[list[dict[str, Any]], Path]) -> None:
    reports, out = resume_run
    step_4 = out / "fsdp2-crashed" / "checkpoints" / "step_4"
    recipe = tiny_recipe(tmp_path / "single", fused=True, max_steps=6, checkpoint={"enabled": True,
                         "resume": str(step_4)}, step_scheduler={"val_every_steps": 3})
    job = FinetuneRecipe(validate_recipe(recipe))
    result = job.run()
    assert job.resumed_from == step_4 and [r.step for r in result.records] == [5, 6]
    # 2 ranks -> 1 process: DCP reshards; only the summation order of the steps differs.
    straight = reports[0]["fsdp2"]["straight"]
    torch.testing.assert_close(torch.tensor([r.loss for r in result.records]), torch.tensor(straight["loss"][4:]),
                               atol=1e-5, rtol=0)


def test_fsdp2_export_loads_in_transformers_with_the_sharded_weights(
        resume_run: tuple[list[dict[str, Any]], Path]) -> None:
    _, out = resume_run
    final = out / "fsdp2-crashed" / "checkpoints" / "step_6"
    exported = AutoModelForCausalLM.from_pretrained(final / "model")
    config = json.loads((final / "model" / "config.json").read_text())
    assert config["use_cache"] is True and config["num_hidden_layers"] == 2
    rebuilt = AutoModelForCausalLM.from_pretrained(final / "model")  # same architecture, weights replaced below
    with torch.no_grad():
        for param in rebuilt.parameters():
            param.zero_()
    load_sharded_checkpoint(final, model=rebuilt)
    expected = rebuilt.state_dict()
    assert set(exported.state_dict()) == set(expected)
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert any(t.abs().sum() > 0 for t in expected.values())


def test_a_stop_request_on_one_rank_stops_all_ranks_after_the_same_step(
        resume_run: tuple[list[dict[str, Any]], Path]) -> None:
    reports, out = resume_run
    expected = out / "fsdp2-stopped" / "checkpoints" / "step_2"
    for report in reports:
        stopped = report["stop-on-one-rank"]
        assert (stopped["final_step"], stopped["stopped_early"]) == (2, True)
        assert Path(stopped["last_checkpoint"]) == expected
    assert [p.name for p in list_checkpoints(expected.parent)] == ["step_2"]
