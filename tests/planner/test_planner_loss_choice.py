"""The planner choosing the loss (``activation_checkpointing: {mode: auto, loss: choose}``, ``loss_choice="choose"``,
``remat plan --loss-choice choose``): fused when only it fits (the real step within budget), plain when the fused
loss is not faster, ``keep`` unchanged, the recipe path trains with the chosen loss, bad values refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_planner_api import SMALL, _recipe_file  # the small Llama recipe the planner's API tests train
from test_planner_cpu import _real_peak  # the tracked peak of a recipe's real CPU step

from remat.checkpointing import CheckpointPolicy
from remat.errors import ConfigError
from remat.estimate import StepSettings
from remat.models import ModelConfig
from remat.planner import Planner, plan_activation_checkpointing, plan_recipe_auto
from remat.planner.loss_choice import NEAR_TIE, carried_loss_kwargs, count_loss_flops
from remat.recipes.loader import load_recipe, validate_recipe

LLAMA = ModelConfig(preset="tiny-llama")  # 4 blocks, hidden 256, vocabulary 8192: the logits weigh
SHAPE = {"batch_size": 2, "seq_length": 512}


def _loss_flops(loss: str, shape: dict[str, object]) -> int:
    settings = StepSettings(target="cpu", loss=loss, **shape)  # type: ignore[arg-type]
    return count_loss_flops(settings.to_recipe(LLAMA), settings.run())


def _full_peak(loss: str, model: Any = LLAMA, **shape: Any) -> int:
    planner = Planner.from_settings(model, StepSettings(target="cpu", loss=loss, **(shape or SHAPE)))
    return planner.estimate(CheckpointPolicy(mode="full")).peak_bytes


def test_choose_takes_the_fused_loss_when_only_it_fits_and_the_real_step_stays_within_budget() -> None:
    plain, fused = _full_peak("plain"), _full_peak("fused")
    assert fused < plain
    budget = (plain + fused) // 2
    with pytest.raises(ConfigError, match=r"nothing fits .* What would help: .*the fused loss \(loss='fused' never "
                                          r"holds the logits\)"):
        plan_activation_checkpointing(LLAMA, memory_budget=budget, target="cpu", **SHAPE)  # keep: the plain loss
    plan = plan_activation_checkpointing(LLAMA, memory_budget=budget, target="cpu", loss_choice="choose", **SHAPE)
    assert plan.loss == "fused" and plan.to_dict()["loss"] == "fused"
    assert plan.peak_bytes <= budget
    assert any("loss chosen by the planner" in note and "plain: nothing fits" in note for note in plan.notes)
    recipe = StepSettings(target="cpu", loss="fused", policy=plan.policy.to_dict(), **SHAPE).to_recipe(LLAMA)
    real = _real_peak(recipe)
    assert real == plan.peak_bytes and real <= budget, (real, plan.peak_bytes, budget)


def test_choose_keeps_the_plain_loss_when_the_fused_loss_is_not_faster() -> None:
    # bfloat16 over several token chunks: the fused loss recomputes the logits in backward (4 matmuls, not 3)
    shape = {"batch_size": 2, "seq_length": 1024, "dtype": "bfloat16"}
    flops = {loss: _loss_flops(loss, shape)
             for loss in ("plain", "fused")}
    assert flops["fused"] > flops["plain"], flops
    plan = plan_activation_checkpointing(LLAMA, memory_budget="2GiB", target="cpu", loss_choice="choose", **shape)
    assert plan.loss == "plain" and plan.policy == CheckpointPolicy(mode="none") and plan.recompute_flops == 0
    note = next(note for note in plan.notes if "loss chosen by the planner" in note)
    assert note.endswith(f"plain: 0 s; fused: {(flops['fused'] - flops['plain']) / plan.flops_per_second:.4g} s")
    kept = plan_activation_checkpointing(LLAMA, memory_budget="2GiB", target="cpu", **shape)
    assert kept.loss == "plain" and kept.policy == plan.policy and not any("loss chosen" in n for n in kept.notes)


def test_a_near_tie_keeps_the_recipes_own_loss() -> None:
    # float32: the fused loss runs the same matmuls on the labelled tokens only, a sliver fewer FLOPs than plain's
    flops = {loss: _loss_flops(loss, SHAPE) for loss in ("plain", "fused")}
    assert flops["fused"] < flops["plain"], flops
    plan = plan_activation_checkpointing(LLAMA, memory_budget="2GiB", target="cpu", loss_choice="choose", **SHAPE)
    assert (flops["plain"] - flops["fused"]) < NEAR_TIE * plan.step_flops
    assert plan.loss == "plain" and plan.policy == CheckpointPolicy(mode="none")


def test_an_auto_recipe_with_planner_loss_choose_trains_with_the_chosen_loss(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main

    # `_recipe_file`'s small Llama with a larger vocabulary and longer rows: the logits weigh in its peak
    larger = {"model.config.vocab_size": 2048, "tokenizer.vocab_size": 2048, "dataset.seq_length": 256}
    small = ModelConfig.model_validate({**SMALL, "config": {**SMALL["config"], "vocab_size": 2048}})
    plain, fused = (_full_peak(loss, small, batch_size=2, seq_length=256) for loss in ("plain", "fused"))
    assert fused < plain
    budget = (plain + fused) // 2
    path = _recipe_file(tmp_path, activation_checkpointing="auto", planner_loss="choose")
    cfg, plan = plan_recipe_auto(load_recipe(path, [*larger.items(), ("distributed.memory_budget", budget),
                                           ("loss_fn.ignore_index", -100)]))
    assert plan is not None and plan.loss == "fused"
    assert cfg.loss_fn.target == "remat.loss.FusedLinearCrossEntropy" and cfg.loss_fn.kwargs == {"ignore_index": -100}
    assert cfg.distributed.policy == plan.policy
    overrides = [item for key, value in larger.items() for item in (f"--{key}", str(value))]
    assert main(["finetune", str(path), *overrides, "--distributed.memory_budget", str(budget), "--logging.memory",
                 "tracked", "--logging.metrics_file", "m.jsonl"]) == 0
    steps = [r for r in map(json.loads, (tmp_path / "run" / "m.jsonl").read_text().splitlines()) if "mem_bytes" in r]
    assert len(steps) == 2 and all(r["mem_bytes"] <= budget for r in steps), (steps, budget)
    # every process of the run reads the chosen loss from the run's plan file, with the policy
    saved = json.loads((tmp_path / "run" / "auto_plan.json").read_text())
    assert saved["loss_fn"] == {"_target_": "remat.loss.FusedLinearCrossEntropy", "ignore_index": -100} or \
        saved["loss_fn"] == {"_target_": "remat.loss.FusedLinearCrossEntropy"}
    assert saved["activation_checkpointing"]["plan"] == plan.policy.to_dict()
    capsys.readouterr()
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), *overrides, "--distributed.planner_loss", "keep", "--budget", str(budget),
                 "--loss-choice", "choose", "--json", str(out)]) == 0
    assert ("loss chosen by the planner (distributed.activation_checkpointing.loss: choose): fused"
            in capsys.readouterr().out)
    assert json.loads(out.read_text())["budgets"][0]["loss"] == "fused"


def test_bad_values_and_losses_that_cannot_be_chosen_are_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"distributed.activation_checkpointing.loss: got 'maybe'; allowed: 'keep' or "
                                          r"'choose'"):
        validate_recipe({"model": SMALL, "distributed": {"activation_checkpointing": {"mode": "auto",
                                                                                       "loss": "maybe"}}})
    with pytest.raises(ConfigError, match=r"^loss_choice: got 'fused'; allowed: keep, choose$"):
        plan_activation_checkpointing(LLAMA, memory_budget="1GiB", target="cpu", loss_choice="fused", **SHAPE)
    softcap = {"_target_": "remat.loss.FusedLinearCrossEntropy", "logit_softcap": 30.0}
    with pytest.raises(ConfigError, match=r"distributed.activation_checkpointing.loss: choose cannot give the plain loss .* the "
                                          r"recipe's loss_fn.logit_softcap"):
        plan_recipe_auto(load_recipe(_recipe_file(tmp_path, activation_checkpointing="auto", planner_loss="choose"),
                            [("distributed.memory_budget", "1GiB"), ("loss_fn", softcap)]))
    with pytest.raises(ConfigError, match=r"distributed.activation_checkpointing.loss: choose picks between .* the "
                                          r"recipe's loss_fn._target_ is 'mypackage.MyLoss'; use "
                                          r"distributed.activation_checkpointing.loss: keep"):
        plan_activation_checkpointing(LLAMA, memory_budget="1GiB", target="cpu", loss="mypackage.MyLoss",
                                      loss_choice="choose", **SHAPE)


def test_the_recipes_loss_arguments_carry_over_and_fused_execution_settings_are_dropped_for_plain() -> None:
    fused = {"ignore_index": -1, "reduction": "sum", "chunk_size": 8, "grad_strategy": "recompute"}
    assert carried_loss_kwargs(fused, "plain") == {"ignore_index": -1, "reduction": "sum"}
    assert carried_loss_kwargs({"ignore_index": -1}, "fused") == {"ignore_index": -1}
