"""The numerics guard: a NaN/inf loss or gradient norm never reaches the weights (``training.on_nonfinite: skip``
skips the update, ``stop`` stops before it), nothing non-finite is saved, and a non-finite checkpoint is not resumed."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from test_finetune import _isolated_cache, run, tiny_recipe  # noqa: F401  (the fixture keeps one tokenizer cache)

from remat import cli
from remat.distributed import DistributedSetup
from remat.errors import ConfigError, TrainingDivergedError
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe
from remat.recipes.run_safety.numerics import NonFiniteGuard, non_finite_tensors, nonfinite_flag, step_unless
from remat.recipes.reports.reporting import StepRecord

SINGLE = DistributedSetup()
NAN, INF = float("nan"), float("inf")


# ------------------------------------------------------------------------------------------------ the pieces


@pytest.mark.parametrize(("loss", "norm", "expected"), [
    (2.0, 1.0, 0.0), (NAN, 1.0, 1.0), (2.0, INF, 1.0), (-INF, 1.0, 1.0), (2.0, NAN, 1.0), (3e38, 3e38, 0.0),
])
def test_the_flag_is_set_by_a_non_finite_loss_or_norm(loss: float, norm: float, expected: float) -> None:
    flag = nonfinite_flag(torch.tensor(loss), torch.tensor(norm), SINGLE)
    assert flag.dtype == torch.float32 and flag.shape == () and float(flag) == expected


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer-state tensor, cloned (keys name them)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        out.update({f"{names[id(param)]}/{k}": v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def assert_byte_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key].reshape(-1).view(torch.uint8), b[key].reshape(-1).view(torch.uint8)), key


def two_steps(optimizer_cls: Callable[..., torch.optim.Optimizer], **kwargs: Any) -> Iterator[Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    optimizer = optimizer_cls(model.parameters(), lr=0.1, **kwargs)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        yield model, optimizer


@pytest.mark.parametrize(("optimizer_cls", "kwargs", "on_device"), [
    (torch.optim.AdamW, {"fused": True, "weight_decay": 0.1}, True),    # found_inf: skipped without a host sync
    (torch.optim.SGD, {"fused": True, "momentum": 0.9}, True),
    (torch.optim.AdamW, {"foreach": False, "weight_decay": 0.1}, False),  # one host read of the flag
    (torch.optim.AdamW, {"foreach": True}, False),
], ids=["fused-adamw", "fused-sgd", "adamw", "adamw-foreach"])
def test_a_flagged_update_leaves_weights_and_optimizer_state_byte_equal(
        optimizer_cls: Callable[..., torch.optim.Optimizer], kwargs: dict[str, Any], on_device: bool) -> None:
    from remat.recipes.run_safety.numerics import skips_on_device

    steps = two_steps(optimizer_cls, **kwargs)
    model, optimizer = next(steps)
    assert skips_on_device(optimizer) is on_device
    step_unless(optimizer, torch.tensor(0.0))  # the first update creates the state
    before = snapshot(model, optimizer)
    model, optimizer = next(steps)
    next(model.parameters()).grad[0, 0] = NAN
    step_unless(optimizer, torch.tensor(1.0))
    assert_byte_equal(before, snapshot(model, optimizer))
    assert not hasattr(optimizer, "found_inf")  # handed back as GradScaler does
    # An unflagged step is the plain step, bit for bit.
    next(model.parameters()).grad[0, 0] = 0.5
    step_unless(optimizer, torch.tensor(0.0))
    changed = snapshot(model, optimizer)
    assert all(not torch.equal(changed[k], before[k]) for k in before)


def test_the_guard_runs_on_fake_tensors_and_takes_the_step() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        flag = nonfinite_flag(torch.randn(()), torch.randn(()), SINGLE)
        step_unless(optimizer, flag)  # no host read of a fake value
        assert "exp_avg" in optimizer.state[model.weight]


def record(step: int, skipped: bool) -> StepRecord:
    return StepRecord(step=step, epoch=0, loss=NAN if skipped else 1.0, grad_norm=1.0, lr=1e-3, mem_bytes=0,
                      mem_source="rss", tps=1.0, num_label_tokens=1, step_time_s=0.1, skipped=skipped)


def test_skip_tolerates_max_consecutive_steps_and_a_finite_step_resets_the_count() -> None:
    guard = NonFiniteGuard(policy="skip", max_consecutive=2)
    assert guard.after_step(record(1, False), None) is None
    line = guard.after_step(record(2, True), None)
    assert line is not None and line.startswith("step 2: loss nan and grad_norm 1.0: not finite, so its update was "
                                                "not applied") and "1 of at most 2 such steps in a row" in line
    guard.after_step(record(3, True), None)
    guard.after_step(record(4, False), None)  # resets
    guard.after_step(record(5, True), None)
    guard.after_step(record(6, True), Path("ck/step_4"))
    with pytest.raises(TrainingDivergedError, match=r"^step 7: loss nan and grad_norm 1.0: training diverged \(3 in a "
                                                    r"row, more than training.max_nonfinite_steps: 2\); the update was "
                                                    r"not applied .*the last good checkpoint is ck/step_4"):
        guard.after_step(record(7, True), Path("ck/step_4"))
    assert guard.total == 5


def test_stop_raises_on_the_first_non_finite_step() -> None:
    guard = NonFiniteGuard(policy="stop", max_consecutive=3)
    with pytest.raises(TrainingDivergedError, match=r"\(training.on_nonfinite: stop\).*no checkpoint was saved yet"):
        guard.after_step(record(1, True), None)


def test_non_finite_tensors_names_parameters_and_optimizer_state() -> None:
    model, optimizer = next(two_steps(torch.optim.AdamW))
    optimizer.step()
    assert non_finite_tensors(model, optimizer, SINGLE) == []
    with torch.no_grad():
        model[0].bias.fill_(1e30)  # finite, but its 2-norm overflows float32
    assert non_finite_tensors(model, optimizer, SINGLE) == []
    with torch.no_grad():
        model[1].bias[0] = INF
    optimizer.state[model[0].weight]["exp_avg_sq"][0, 0] = NAN
    assert non_finite_tensors(model, optimizer) == ["1.bias", "optimizer state exp_avg_sq of 0.weight"]


@pytest.mark.parametrize(("key", "value", "fragments"), [
    ("on_nonfinite", "ignore", ["training.on_nonfinite", "'ignore'", "'skip' or 'stop'"]),
    ("max_nonfinite_steps", 0, ["training.max_nonfinite_steps", "greater than 0"]),
])
def test_the_training_section_is_validated(tmp_path: Path, key: str, value: Any, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        validate_recipe(tiny_recipe(tmp_path, training={key: value}))
    assert all(fragment in str(info.value) for fragment in fragments), str(info.value)


# ------------------------------------------------------------------------------------------------ whole runs


def inf_grad_at(steps: set[int]) -> Callable[[FinetuneRecipe, Any], None]:
    """A callback that makes one gradient infinite during the given steps (the hook is set after the step before)."""
    handles: list[Any] = []

    def callback(job: FinetuneRecipe, rec: Any) -> None:
        while handles:
            handles.pop().remove()
        if rec.step + 1 in steps:
            param = next(job.model.parameters())
            handles.append(param.register_hook(lambda grad: grad * INF))
    return callback


@pytest.mark.parametrize("fused", [False, True], ids=["sync", "found_inf"])
def test_skip_leaves_the_state_of_a_non_finite_step_untouched_and_goes_on(
        tmp_path: Path, fused: bool, capsys: pytest.CaptureFixture[str]) -> None:
    states: dict[int, dict[str, torch.Tensor]] = {}
    lrs: dict[int, float] = {}

    def keep(job: FinetuneRecipe, rec: Any) -> None:
        states[rec.step] = snapshot(job.model, job.optimizer)
        lrs[rec.step] = job.optimizer.param_groups[0]["lr"]

    recipe = tiny_recipe(tmp_path, training={"on_nonfinite": "skip"}, optimizer={"fused": fused},
                         step_scheduler={"max_steps": 5, "ckpt_every_steps": 3})
    job, result = run(recipe, callbacks=[keep, inf_grad_at({3})])
    assert [r.skipped for r in result.records] == [False, False, True, False, False]
    assert not math.isfinite(result.records[2].grad_norm) and result.final_step == 5
    assert_byte_equal(states[2], states[3])  # weights, exp_avg, exp_avg_sq and the optimizer's step count
    assert not torch.equal(states[3]["model.embed_tokens.weight"], states[4]["model.embed_tokens.weight"])
    assert lrs[3] != lrs[2]  # the schedule moved on
    assert all(torch.isfinite(t).all() for t in states[5].values())
    out = capsys.readouterr().out
    assert "| skipped (not finite)" in out and "step 3: loss " in out and "its update was not applied" in out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["skipped"] for row in rows if row["kind"] == "train"] == [False, False, True, False, False]
    assert sorted(p.name for p in job.checkpoint_dir.glob("step_*")) == ["step_3", "step_5"]


def test_the_issue_divergence_stops_keeps_the_last_good_checkpoint_and_exits_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --optimizer.lr 1e4 --clip_grad_norm.max_norm null: the gradient norm becomes NaN at step 4 on this model.
    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 8, "ckpt_every_steps": 2}, checkpoint={"keep_last": 1},
                         lr_scheduler={"warmup_steps": 0})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = cli.main(["finetune", str(path), "--optimizer.lr", "1e4", "--clip_grad_norm.max_norm", "null"])
    captured = capsys.readouterr()
    assert code == 2
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "training diverged (training.on_nonfinite: stop); the update was not applied" in \
        errors[0] and errors[0].endswith("then resume from that checkpoint"), captured.err
    checkpoints = tmp_path / "run" / "checkpoints"
    assert f"the last good checkpoint is {checkpoints / 'step_2'}" in errors[0]
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_2"]
    model = load_file(checkpoints / "step_2" / "model" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in model.values())


def test_skip_stops_after_the_bound(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, training={"on_nonfinite": "skip", "max_nonfinite_steps": 2},
                         step_scheduler={"max_steps": 8, "ckpt_every_steps": 2})
    seen: list[int] = []
    with pytest.raises(TrainingDivergedError, match=r"^step 5: .*\(3 in a row, more than "
                                                    r"training.max_nonfinite_steps: 2\)"):
        run(recipe, callbacks=[lambda job, rec: seen.append(rec.step), inf_grad_at({3, 4, 5, 6})])
    assert seen == [1, 2, 3, 4]
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert ckpts == ["step_2", "step_4"]  # step_4 holds the (finite) weights of step 2


def test_non_finite_weights_are_never_saved(tmp_path: Path) -> None:
    def poison(job: FinetuneRecipe, rec: Any) -> None:
        if rec.step == 2:
            with torch.no_grad():
                job.model.model.norm.weight[0] = NAN

    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 4, "ckpt_every_steps": 2})
    with pytest.raises(TrainingDivergedError, match=r"^refusing to save checkpoint step_2: NaN or infinite values in "
                                                    r"1 tensor\(s\) \(model.norm.weight\); nothing was saved or pruned"):
        run(recipe, callbacks=[poison])
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))


def test_a_non_finite_checkpoint_is_not_resumed(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 2})
    job, _ = run(recipe)
    weights = job.checkpoint_dir / "step_2" / "model" / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.embed_tokens.weight"][3, 1] = INF  # as an older remat could have written it: its marker
    save_file(tensors, weights, metadata={"format": "pt"})  # (format 1) records sizes, not contents
    marker_file = job.checkpoint_dir / "step_2" / "COMPLETE.json"
    marker = json.loads(marker_file.read_text())
    sizes = {rel: (job.checkpoint_dir / "step_2" / rel).stat().st_size for rel in marker["files"]}
    marker_file.write_text(json.dumps({**marker, "format": 1, "files": sizes}))
    more = tiny_recipe(tmp_path, step_scheduler={"max_steps": 4})
    with pytest.raises(ConfigError, match=rf"no checkpoint in {job.checkpoint_dir} verifies and loads: step_2 "
                                          r"\(loading failed with TrainingDivergedError: checkpoint .*step_2 holds NaN or "
                                          r"infinite values in 1 tensor\(s\) \(model.embed_tokens.weight\): "
                                          r"refusing to resume from it"):
        run(more)
    assert sorted(p.name for p in job.checkpoint_dir.glob("step_*")) == ["step_2"]


def test_a_run_never_finite_names_the_recipe_values_out_of_any_usual_range(tmp_path: Path) -> None:
    """A negative rope_theta makes every rotary frequency NaN: the stop names it, not only "training diverged"."""
    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 2})
    recipe["model"]["config"] = {**recipe["model"].get("config", {}), "rope_theta": -10000.0}
    with pytest.raises(TrainingDivergedError) as info:
        run(recipe)
    message = str(info.value)
    assert message.startswith("step 1: loss nan and grad_norm nan (never finite in this run; out of any usual range: "
                              "model.config.rope_theta = -10000.0 (usual: 1e4 to 1e7))")
