"""Resuming with a changed recipe: each change is applied (and said), compatible (re-sharded) or refused with one
line; runs without an output_dir get their own directory."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
import yaml
from pydantic import BaseModel
from test_finetune import run, tiny_recipe

from remat.cli import main
from remat.data.loader import StatefulBatchIterator
from remat.errors import ConfigError
from remat.recipes.config import RecipeConfig
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import load_recipe, validate_recipe
from remat.recipes.lr_schedule import lr_multiplier
from remat.recipes.run_safety.resume_changes import config_differences, plan_resume
from remat.recipes.run_safety.resume_rules import APPLIED, COMPATIBLE, REFUSED, WARNED, rule_for
from remat.training_state import find_latest_checkpoint


def stop_at(step: int) -> Callable[[FinetuneRecipe, Any], None]:
    def callback(job: FinetuneRecipe, record: Any) -> None:
        if record.step == step:
            job.request_stop("test")
    return callback


def lrs(result: Any) -> list[float]:
    return [r.lr for r in result.records]


# ------------------------------------------------------------------------------------------------ applied


def test_a_new_lr_is_applied_from_the_first_resumed_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 8}), callbacks=[stop_at(4)])
    job, result = run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 8}, optimizer={"lr": 6e-3}))
    assert [r.step for r in result.records] == [5, 6, 7, 8]
    schedule = job.cfg.lr_scheduler
    assert lrs(result) == pytest.approx([6e-3 * lr_multiplier(s, schedule, 8) for s in range(4, 8)], rel=1e-12)
    # warmup 2 of 8 steps, cosine: step 4 is 1/3 into the decay, 0.1 + 0.9 x 0.75 of the new lr.
    assert lrs(result)[0] == pytest.approx(6e-3 * 0.775, rel=1e-12)
    assert job.optimizer.param_groups[0]["initial_lr"] == 6e-3
    out = capsys.readouterr().out
    assert "resume: optimizer.lr: 0.003 -> 0.006 (applied: the lr schedule is rebuilt" in out
    assert f"step 5 trains with lr {6e-3 * lr_multiplier(4, schedule, 8):.4g} (the saved schedule had " in out


def test_raising_max_steps_continues_the_new_cosine_downwards(tmp_path: Path) -> None:
    run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 4}))
    old_next = 3e-3 * lr_multiplier(4, validate_recipe(tiny_recipe(tmp_path)).lr_scheduler, 4)
    job, result = run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 8}))
    expected = [3e-3 * lr_multiplier(s, job.cfg.lr_scheduler, 8) for s in range(4, 8)]
    assert lrs(result) == pytest.approx(expected, rel=1e-12)
    # The old schedule would have used its floor (0.1 x lr) here; the new one stands at 1/3 of its decay.
    assert old_next == pytest.approx(3e-4) and lrs(result)[0] == pytest.approx(3e-3 * (0.1 + 0.9 * 0.75))
    assert all(later < earlier for earlier, later in zip(lrs(result), lrs(result)[1:]))


def test_other_optimizer_hyperparameters_reach_the_param_groups(tmp_path: Path) -> None:
    run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 4}), callbacks=[stop_at(2)])
    job, _ = run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 4},
                             optimizer={"weight_decay": 0.5, "betas": [0.8, 0.9]}))
    group = job.optimizer.param_groups[0]
    assert group["weight_decay"] == 0.5 and list(group["betas"]) == [0.8, 0.9]
    assert job.step == 4 and job.optimizer.state  # the saved moments were loaded, then the values applied


# ------------------------------------------------------------------------------------------------ refused


def _one_line(err: pytest.ExceptionInfo[ConfigError]) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def _jsonl(path: Path, words: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": f"{w} " * 20}) + "\n" for w in words))
    return path


def test_other_data_with_the_same_row_count_is_refused(tmp_path: Path) -> None:
    first = _jsonl(tmp_path / "a.jsonl", ["alpha", "beta", "gamma", "delta"] * 4)
    other = _jsonl(tmp_path / "b.jsonl", ["one", "two", "three", "four"] * 4)
    data = {"packing": False, "seq_length": 16}
    run(tiny_recipe(tmp_path, dataset={**data, "path": str(first)}, step_scheduler={"max_steps": 2}))
    with pytest.raises(ConfigError) as err:
        run(tiny_recipe(tmp_path, dataset={**data, "path": str(other)}, step_scheduler={"max_steps": 4}))
    line = _one_line(err)
    assert "dataset: the tokenized training data differs from the saved run's" in line and "16 vs 16 rows" in line
    assert f'dataset.path: "{first}" (saved) vs "{other}" (now)' in line and "use another output_dir" in line
    # The same content under another name is the same data: accepted and said.
    moved = (tmp_path / "moved.jsonl")
    moved.write_bytes(first.read_bytes())
    job, result = run(tiny_recipe(tmp_path, dataset={**data, "path": str(moved)}, step_scheduler={"max_steps": 3}))
    assert [r.step for r in result.records] == [3]
    assert any("dataset.path" in note and "the tokenized data is identical" in note for note in job.resume_notes)


def test_a_checkpoint_without_a_fingerprint_warns_and_resumes(tmp_path: Path) -> None:
    _, first = run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 2}))
    state = json.loads((first.last_checkpoint / "train_state.json").read_text())
    assert state["data_fingerprint"].startswith("blake2b-128/v1:")
    old = tmp_path / "old" / "step_2"  # as saved before fingerprints existed
    old.mkdir(parents=True)
    (old / "train_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "data_fingerprint"}))
    job = FinetuneRecipe(validate_recipe(tiny_recipe(tmp_path, checkpoint={"enabled": False})))
    job.setup()
    plan = plan_resume(old, job.cfg, data_fingerprint=job.data_fingerprint, batches=job.batches,
                       optimizer=job.optimizer)
    assert (f"resume: {old} predates data fingerprints, so the training data cannot be checked to be the same (only "
            f"its row count, {len(job.train_data)})") in plan.notes
    # A different row count is still refused, by that count.
    state["data"]["num_rows"] += 1
    (old / "train_state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "data_fingerprint"}))
    with pytest.raises(ConfigError, match=rf"dataset: the training data has {len(job.train_data)} rows, the saved "
                                          rf"run's had {len(job.train_data) + 1}: the saved data position"):
        plan_resume(old, job.cfg, data_fingerprint=job.data_fingerprint, batches=job.batches, optimizer=job.optimizer)


def test_adamw_to_sgd_is_refused_with_one_line(tmp_path: Path) -> None:
    _, first = run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 2}))
    with pytest.raises(ConfigError) as err:
        run(tiny_recipe(tmp_path, optimizer={"_target_": "torch.optim.SGD", "lr": 3e-3}))
    line = _one_line(err)
    assert line.startswith(f"cannot resume {first.last_checkpoint} with this recipe: optimizer._target_: "
                           '"torch.optim.AdamW" (saved) vs "torch.optim.SGD" (now): the saved optimizer state')
    assert find_latest_checkpoint(tmp_path / "run" / "checkpoints") == first.last_checkpoint


def test_a_model_change_is_refused_with_one_line(tmp_path: Path) -> None:
    run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 2}))
    model = {"preset": "tiny-llama", "config": {"hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 3,
                                                "num_attention_heads": 4, "num_key_value_heads": 2}}
    with pytest.raises(ConfigError) as err:
        run(tiny_recipe(tmp_path, model=model))
    line = _one_line(err)
    assert "model.config.hidden_size: 64 (saved) vs 96 (now): the saved weights and optimizer state belong to the " \
           "other model" in line
    assert "model.config.num_hidden_layers: 2 (saved) vs 3 (now)" in line


def test_a_directory_of_another_model_is_refused_before_the_data_and_the_model_are_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal needs only the recipes (the one saved with each checkpoint and this one): it comes before the
    tokenizer, the dataset and the model are built, not after minutes of tokenizing and loading."""
    run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 2}))
    import remat.recipes.finetune as finetune

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("built before the refusal")

    monkeypatch.setattr(finetune, "build_tokenizer", never)
    monkeypatch.setattr(finetune, "build_recipe_model", never)
    with pytest.raises(ConfigError, match=r"^cannot resume .*step_2 with this recipe: seed: 7 \(saved\) vs 8 \(now\)"):
        run(tiny_recipe(tmp_path, seed=8))


def test_the_early_check_reads_a_planted_train_state_as_nothing(tmp_path: Path) -> None:
    """The recipes are compared before any checkpoint is verified: a FIFO, a link or a huge file named
    train_state.json is not read (no hang, no file outside the run); loading the checkpoint then reports it."""
    import os

    from remat.recipes.run_safety.resume_changes import early_refusal

    cfg = validate_recipe(tiny_recipe(tmp_path))
    fifo, link, huge = (tmp_path / name for name in ("fifo", "link", "huge"))
    for step in (fifo, link, huge):
        step.mkdir()
    os.mkfifo(fifo / "train_state.json")
    (tmp_path / "outside.json").write_text(json.dumps({"config": {"seed": 1}}))
    (link / "train_state.json").symlink_to(tmp_path / "outside.json")
    with open(huge / "train_state.json", "wb") as handle:
        handle.truncate(17 * 2**20)
    for step in (fifo, link, huge):
        assert early_refusal([step], cfg) is None
    (huge / "train_state.json").write_text(json.dumps({"config": {**cfg.model_dump(mode="json", by_alias=True),
                                                                  "seed": 1}}))
    assert "seed: 1 (saved) vs 7 (now)" in str(early_refusal([huge], cfg))


def test_loading_weights_of_another_shape_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    from remat.recipes.build import build_recipe_model
    from remat.training_state.single import load_checkpoint

    _, first = run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 1}))
    model = {"preset": "tiny-llama", "config": {"hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 3,
                                                "num_attention_heads": 4, "num_key_value_heads": 2}}
    other = build_recipe_model(validate_recipe(tiny_recipe(tmp_path, model=model)), vocab_size=512)
    with pytest.raises(ConfigError) as err:
        load_checkpoint(first.last_checkpoint, model=other)
    assert "tensors have another shape (e.g. size mismatch for model.embed_tokens.weight" in _one_line(err)


def test_seed_and_peft_changes_are_refused(tmp_path: Path) -> None:
    run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 1}))
    with pytest.raises(ConfigError, match=r"seed: 7 \(saved\) vs 8 \(now\): the seed draws the data order"):
        run(tiny_recipe(tmp_path, seed=8))


# ------------------------------------------------------------------------------------------------ compatible


def test_the_data_position_is_resharded_to_the_same_global_sample(tmp_path: Path) -> None:
    rows = [{"input_ids": torch.tensor([i]), "labels": torch.tensor([i])} for i in range(24)]
    one = StatefulBatchIterator(rows, 2, seed=3)  # 2 rows per batch, so a step of 4 rows is 2 batches
    drawn = [next(one) for _ in range(6)]  # steps 1-3
    ranks = [StatefulBatchIterator(rows, 2, seed=3, rank=r, world_size=2) for r in range(2)]
    cfg = validate_recipe(tiny_recipe(tmp_path))
    checkpoint = tmp_path / "step_3"
    checkpoint.mkdir()
    (checkpoint / "train_state.json").write_text(json.dumps({"config": cfg.model_dump(mode="json", by_alias=True),
                                                             "data": one.state_dict()}))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    for it in ranks:
        plan = plan_resume(checkpoint, cfg, data_fingerprint=None, batches=it, optimizer=optimizer)
        it.load_state_dict(plan.data_state(one.state_dict(), it))
    assert "continuing at row 12 of epoch 0, the same global sample" in plan.notes[-1]
    expected = [next(one) for _ in range(2)]  # step 4 of the one-process run
    got = torch.cat([next(it)["input_ids"] for it in ranks])
    assert got.flatten().tolist() == torch.cat([b["input_ids"] for b in expected]).flatten().tolist()
    assert all(b["input_ids"].flatten().tolist() != got.flatten().tolist()[:2] for b in drawn)


def test_a_position_that_cannot_be_resharded_is_refused(tmp_path: Path) -> None:
    rows = [{"input_ids": torch.tensor([i]), "labels": torch.tensor([i])} for i in range(24)]
    one = StatefulBatchIterator(rows, 2, seed=3)
    for _ in range(3):  # 6 rows: not a multiple of 4
        next(one)
    cfg = validate_recipe(tiny_recipe(tmp_path))
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "train_state.json").write_text(
        json.dumps({"config": cfg.model_dump(mode="json", by_alias=True), "data": one.state_dict()}))
    two = StatefulBatchIterator(rows, 2, seed=3, world_size=2)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError, match=r"row 6 of epoch 0, in batches of 2 rows\) is not a multiple of this "
                                          r"run's 4 rows per batch"):
        plan_resume(tmp_path / "step_1", cfg, data_fingerprint=None, batches=two, optimizer=optimizer)


def test_a_new_local_batch_size_with_the_same_global_batch_continues_the_same_losses(tmp_path: Path) -> None:
    _, straight = run(tiny_recipe(tmp_path / "straight", lr_scheduler={"decay": "constant"}))
    recipe = tiny_recipe(tmp_path / "split", lr_scheduler={"decay": "constant"})
    run(recipe, callbacks=[stop_at(3)])
    job, second = run({**recipe, "step_scheduler": {**recipe["step_scheduler"], "local_batch_size": 4}})
    assert job.grad_accumulation == 1 and [r.step for r in second.records] == [4, 5, 6]
    torch.testing.assert_close(torch.tensor([r.loss for r in second.records]),
                               torch.tensor([r.loss for r in straight.records[3:]]), atol=1e-5, rtol=0)
    assert any(note.startswith("resume: step_scheduler.local_batch_size: 2 -> 4 (compatible") for note in
               job.resume_notes)


# ------------------------------------------------------------------------------------------------ run identity


def test_two_recipes_without_output_dir_never_share_a_directory(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name, lr in (("first", 3e-3), ("second", 1e-3)):
        recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 2}, optimizer={"lr": lr})
        del recipe["output_dir"]
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
    first, second = load_recipe(tmp_path / "first.yaml"), load_recipe(tmp_path / "second.yaml")
    assert (first.output_dir, second.output_dir) == ("outputs/first", "outputs/second")
    FinetuneRecipe(first).run()
    job = FinetuneRecipe(second)
    result = job.run()
    assert job.resumed_from is None and [r.step for r in result.records] == [1, 2]
    assert result.records[0].lr == pytest.approx(1e-3 * lr_multiplier(0, second.lr_scheduler, 2))
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["first", "second"]
    assert find_latest_checkpoint(tmp_path / "outputs" / "first" / "checkpoints").name == "step_2"
    # An explicit output_dir still wins.
    assert load_recipe(tmp_path / "first.yaml", ["--output_dir", "elsewhere"]).output_dir == "elsewhere"


def test_a_different_run_in_the_same_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    for folder, hidden in (("a", 64), ("b", 96)):
        recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 1})
        del recipe["output_dir"]
        recipe["model"]["config"]["hidden_size"] = hidden
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "train.yaml").write_text(yaml.safe_dump(recipe))
    FinetuneRecipe(load_recipe(tmp_path / "a" / "train.yaml")).run()
    before = sorted((str(p), p.stat().st_mtime_ns) for p in (tmp_path / "outputs").rglob("*"))
    capsys.readouterr()
    assert main(["finetune", str(tmp_path / "b" / "train.yaml")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[remat]")]
    assert len(errors) == 1 and errors[0].startswith("error: cannot resume outputs/train/checkpoints/step_1 with ")
    assert "model.config.hidden_size: 64 (saved) vs 96 (now)" in errors[0]
    assert errors[0].endswith("use another output_dir (now 'outputs/train')")
    assert sorted((str(p), p.stat().st_mtime_ns) for p in (tmp_path / "outputs").rglob("*")) == before


def test_python_configs_without_output_dir_get_one_per_run_identity(tmp_path: Path) -> None:
    def config(**sections: Any) -> RecipeConfig:
        recipe = tiny_recipe(tmp_path, **sections)
        del recipe["output_dir"]
        return RecipeConfig.model_validate(recipe)

    base = config()
    assert base.output_dir.startswith("outputs/run-") and len(base.output_dir) == len("outputs/run-") + 8
    assert config(optimizer={"lr": 1e-3}).output_dir == base.output_dir  # an applied change: the same run
    assert config(seed=8).output_dir != base.output_dir
    assert config(dataset={"seq_length": 64}).output_dir != base.output_dir


# ------------------------------------------------------------------------------------------------ the table


def _schema_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        nested = [a for a in (info.annotation, *get_args(info.annotation))
                  if isinstance(a, type) and issubclass(a, BaseModel)]
        keys += _schema_keys(nested[0], key + ".") if nested else [key]
    return keys


def test_every_recipe_key_has_a_rule() -> None:
    keys = _schema_keys(RecipeConfig)
    assert len(keys) > 50 and "optimizer._target_" in keys and "model.config" in keys
    unclassified = [key for key in keys if rule_for(key).kind == WARNED]
    assert unclassified == []
    assert rule_for("model.config.hidden_size").kind == REFUSED
    assert rule_for("optimizer.momentum").kind == APPLIED and rule_for("optimizer.amsgrad").kind == REFUSED
    assert rule_for("distributed.dp_size").kind == COMPATIBLE
    assert rule_for("a_key_from_another_version").kind == WARNED


def test_config_differences_name_whole_sections_set_on_one_side() -> None:
    changes = list(config_differences({"peft": None, "a": {"b": 1, "c": 2}}, {"peft": {"r": 8}, "a": {"b": 1}}))
    assert [(c.key, c.values()) for c in changes] == [("a.c", "2 (saved) vs (not set) (now)"),
                                                      ("peft", 'null (saved) vs {"r": 8} (now)')]


def test_many_refused_keys_still_make_one_short_line(tmp_path: Path) -> None:
    cfg = validate_recipe(tiny_recipe(tmp_path))
    saved = cfg.model_dump(mode="json", by_alias=True)
    saved["model"]["config"] = {**saved["model"]["config"], **{f"extra_{i}": i for i in range(10)}}
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / "train_state.json").write_text(json.dumps({"config": saved}))
    rows = [{"input_ids": torch.tensor([i]), "labels": torch.tensor([i])} for i in range(8)]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError) as err:
        plan_resume(tmp_path / "step_1", cfg, data_fingerprint=None, batches=StatefulBatchIterator(rows, 2),
                    optimizer=optimizer)
    line = _one_line(err)
    assert line.count("(saved) vs (not set) (now)") == 4 and "; and 6 more. To continue that run" in line
