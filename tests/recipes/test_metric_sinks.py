"""TensorBoard and Weights & Biases are optional sinks: scalars reach them, a resumed run continues the same W&B run,
and a missing package is one line naming the extra. A stand-in ``wandb`` module records the calls (no network)."""

from __future__ import annotations

import io
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from remat.errors import ConfigError
from remat.recipes.config import LoggingConfig
from remat.recipes.loader import validate_recipe
from remat.recipes.reports.metric_sinks import WANDB_ID_FILE
from remat.recipes.reports.reporting import RunReporter, StepRecord


class FakeRun:
    def __init__(self, calls: list[tuple[str, Any]], **kwargs: Any) -> None:
        self.calls = calls
        calls.append(("init", kwargs))

    def log(self, values: dict[str, float], step: int) -> None:
        self.calls.append(("log", (step, values)))

    def finish(self) -> None:
        self.calls.append(("finish", None))


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    module = types.ModuleType("wandb")
    module.init = lambda **kwargs: FakeRun(calls, **kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def _record(step: int) -> StepRecord:
    return StepRecord(step=step, epoch=0, loss=2.5, grad_norm=1.0, lr=1e-3, mem_bytes=2**30, mem_source="tracked",
                      tps=100.0, num_label_tokens=10, step_time_s=0.1)


def test_wandb_gets_every_scalar_and_a_resumed_run_continues_it(tmp_path: Path, fake_wandb: list) -> None:
    cfg = validate_recipe({"model": {"preset": "tiny-llama"},
                           "logging": {"progress": "plain", "wandb": {"project": "p", "tags": ["a"]}}}).logging
    for steps in ([1, 2], [3]):
        with RunReporter(cfg, tmp_path, total_steps=3, stream=io.StringIO(), recipe={"seed": 1}) as reporter:
            for step in steps:
                reporter.step(_record(step))
            reporter.validation(steps[-1], 2.0, 7)
    inits = [kwargs for kind, kwargs in fake_wandb if kind == "init"]
    assert len(inits) == 2 and inits[0]["id"] == inits[1]["id"] == (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert inits[0]["project"] == "p" and inits[0]["tags"] == ["a"] and inits[0]["resume"] == "allow"
    assert inits[0]["config"] == {"seed": 1} and inits[0]["dir"] == str(tmp_path)
    logs = [payload for kind, payload in fake_wandb if kind == "log"]
    assert [step for step, _ in logs] == [1, 2, 2, 3, 3]
    assert logs[0][1] == {"train/loss": 2.5, "train/grad_norm": 1.0, "train/lr": 1e-3, "train/tps": 100.0,
                          "train/mem_gib": 1.0}
    assert logs[2][1] == {"validation/loss": 2.0}
    assert [kind for kind, _ in fake_wandb].count("finish") == 2


def test_missing_packages_are_one_line_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"logging.wandb: needs the wandb package: pip install 'remat\[wandb\]'"):
        RunReporter(LoggingConfig(progress="plain", wandb={"project": "p"}), tmp_path, total_steps=1)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"logging.tensorboard: true needs the tensorboard package"):
        RunReporter(LoggingConfig(progress="plain", tensorboard=True), tmp_path, total_steps=1)


def test_a_disabled_reporter_opens_no_sink(tmp_path: Path, fake_wandb: list) -> None:
    RunReporter(LoggingConfig(progress="plain", wandb={"project": "p"}), tmp_path, total_steps=1, enabled=False).close()
    assert fake_wandb == []
