"""Run each `remat profile` setting for a few real steps of the recipe, one after another in this process.

Every setting builds a fresh model, optimizer and data stream from the same recipe and seed (so every setting
trains on the same batches and, every policy being exact, reports the same losses), and runs `FinetuneRecipe`'s own
loop with the checkpointing policy replaced, in a temporary output folder, with checkpoints, validation and the
metrics file off. ``auto`` is planned by the planner for its budget first (one `Planner` for all budgets).

In-process, not in subprocesses: the peaks compared are per step and reset before each one (the CUDA allocator's
``max_memory_allocated``, or on the CPU the exact tracked peak of live tensors), so what an earlier setting left
behind does not show, and the CUDA cache is emptied between settings. The OS's RSS peak would need a process per
setting; it is not reported. The first step of each setting runs under torch's ``FlopCounterMode`` (the counted
FLOPs of the step); it and any further warm-up steps are left out of the medians.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import platform
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import torch

from remat.checkpointing.policy import parse_policy
from remat.errors import ConfigError
from remat.planner.api import default_target, device_bytes, planner_for_recipe, recipe_budget
from remat.checkpointing.budget import parse_budget
from remat.planner.measure import count_ops
from remat.planner.planner import Planner
from remat.planner.profile import PlanSummary, ProfileReport, Setting, SettingResult
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import apply_overrides, validate_recipe

logger = logging.getLogger(__name__)

#: Recipe keys every setting runs with: no checkpoints, validation, metrics file or trackers; memory per step from
#: the allocator (CUDA) or the exact tensor tracker (CPU), never the process RSS (see the module docstring).
RUN_OVERRIDES: tuple[tuple[str, Any], ...] = (
    ("checkpoint.enabled", False), ("step_scheduler.val_every_steps", None), ("logging.metrics_file", None),
    ("logging.tensorboard", False), ("logging.wandb", None), ("logging.memory", "auto"),
    ("logging.log_every_steps", 1),
)


def profile_recipe(data: Mapping[str, Any], settings: Sequence[Setting], *, recipe: str, steps: int, warmup: int = 1,
                   rounds: int = 1, workdir: str | Path | None = None,
                   echo: Callable[[str], None] = print) -> ProfileReport:
    """Run every setting for ``steps`` steps of the recipe ``data`` (its validated mapping, overrides applied) and
    return what each measured; ``warmup`` first steps (at least 1: its FLOPs are counted) leave the medians.
    ``rounds`` > 1 runs the whole list that many times in turn (a fresh model each time), so the drift of a shared
    machine falls on every setting alike. ``auto`` settings are planned first, so a malformed budget stops
    everything before any step runs."""
    if warmup < 1 or steps <= warmup:
        raise ConfigError(f"--steps: got {steps} with --warmup {warmup}; allowed: --warmup >= 1 (the first step is "
                          "counted by the FLOP counter, not timed) and --steps > --warmup")
    if rounds < 1:
        raise ConfigError(f"--rounds: got {rounds}; allowed: an integer >= 1")
    base = apply_overrides(dict(data), [*RUN_OVERRIDES, ("step_scheduler.max_steps", steps)])
    probe = validate_recipe(base)
    target = default_target(probe.distributed.device)
    results = _plan_settings(settings, probe, target, warmup, steps)
    if probe.compile.enabled:
        echo(f"profile: {UNCOUNTED_COMPILED}")
    with _work_folder(workdir) as folder:
        for round_ in range(1, rounds + 1):
            for number, (setting, result) in enumerate(zip(settings, results, strict=True), 1):
                where = f"profile [{number}/{len(settings)}{f', round {round_}/{rounds}' if rounds > 1 else ''}] "
                where += setting.label
                if result.error:
                    if round_ == 1:
                        echo(f"{where}: {result.error}")
                    continue
                echo(f"{where} ({result.policy_text}): {steps} steps, the first {warmup} warm-up")
                cfg = probe.with_checkpointing(parse_policy(result.policy)).model_copy(
                    update={"output_dir": str(folder / _slug(setting.label))})
                _run_setting(cfg, result)
                if result.error:
                    echo(f"{where}: {result.error}")
                elif result.ok:
                    echo(f"{where}: peak {result.peak / 2**30:.3f} GiB, median step {result.median_step_s:.4f} s, "
                         f"{result.tokens_per_s:.0f} tokens/s")
    return ProfileReport(recipe=recipe, device=device_name(target), target=target,
                         torch_version=torch.__version__, steps=steps, warmup=warmup, results=results, rounds=rounds)


def _plan_settings(settings: Sequence[Setting], probe: Any, target: str, warmup: int,
                   steps: int) -> list[SettingResult]:
    """One empty result per setting with its concrete policy; ``auto`` planned for its budget (one `Planner` for
    all), or its error when nothing fits. A budget that is not a size is a `ConfigError` naming ``--budget``."""
    budgets = {s.label: parse_budget(s.budget, device_bytes=device_bytes(target), key="--budget")
               if s.budget is not None else recipe_budget(probe, None, target) for s in settings if s.is_auto}
    planner: Planner | None = None
    results = []
    for setting in settings:
        result = SettingResult(setting.label, warmup=warmup, steps_per_round=steps)
        policy = setting.policy
        if setting.is_auto:
            planner = planner or planner_for_recipe(probe, target=target)
            try:
                plan = planner.plan(budgets[setting.label])
            except ConfigError as err:
                result.error = str(err)
                results.append(result)
                continue
            policy = plan.policy
            result.plan = PlanSummary(plan.budget_bytes, plan.policy.describe(), plan.peak_bytes,
                                      plan.recompute_flops)
        assert policy is not None
        result.policy, result.policy_text = policy.to_dict(), policy.describe()
        results.append(result)
    return results


def _run_setting(cfg: Any, result: SettingResult) -> None:
    """Train ``cfg`` for its steps and add them to ``result`` (an out-of-memory error is recorded, not raised)."""
    run = FinetuneRecipe(cfg)
    try:
        run.setup()
        meter = CountingMeter(run.memory_meter, count=not cfg.compile.enabled)
        run.memory_meter = meter
        records = run.run().records
        result.step_times_s += [r.step_time_s for r in records]
        result.peak_bytes += [r.mem_bytes for r in records]
        result.losses += [r.loss for r in records]
        result.tokens_per_step = round(records[0].tps * records[0].step_time_s) if records else 0
        result.step_flops = result.step_flops or meter.flops
        result.step_memory_bytes = result.step_memory_bytes or meter.memory_bytes
        result.memory_source = meter.source
    except torch.cuda.OutOfMemoryError as err:
        result.error = f"out of memory: {str(err).splitlines()[0]}"
    finally:
        run.release_run_locks()
        run.dist.close()
        del run
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            left = torch.cuda.memory_allocated()
            if left > 2**26:
                logger.warning("profile: %.2f GiB still allocated after %s; the next settings' peaks include it",
                               left / 2**30, result.label)


UNCOUNTED_COMPILED: Final[str] = (
    "compile: the steps are timed, not counted (a counting mode around a step makes dynamo run the compiled blocks "
    "eagerly, then and in every later step), so no rates are fitted from them")
"""What a profile of a recipe that compiles its blocks says (NOTE [ A counted step is never compiled ])."""


class CountingMeter:
    """The recipe's `remat.memory.StepMemoryMeter`, with its first step also counted by op class
    (`remat.planner.measure.count_ops`: ``flops``, matmuls and attention, forward, backward and recompute;
    ``memory_bytes``, what its memory-bound ops wrote) unless ``count`` is False.

    # NOTE [ A counted step is never compiled ]
    # Dynamo does not compile a frame while a dispatch mode that watches ops is active, and it marks that frame to
    # run eagerly from then on: counting the first step of a recipe that compiles its blocks made every later step
    # run eager blocks (measured on the CPU: no graph compiled after one counted call), so `remat profile` timed eager
    # blocks under a compiled recipe's name. Such steps are not counted.
    """

    def __init__(self, inner: Any, *, count: bool = True) -> None:
        self._inner = inner
        self.flops = 0
        self.memory_bytes = 0
        self._counted = not count

    @property
    def source(self) -> str:
        return str(self._inner.source)

    @property
    def last(self) -> Any:
        return self._inner.last

    def mark(self, label: str) -> None:
        self._inner.mark(label)

    @contextlib.contextmanager
    def step(self, **kwargs: Any) -> Iterator[None]:
        """The inner meter's step; the first one counted."""
        if self._counted:
            with self._inner.step(**kwargs):
                yield
            return
        with count_ops() as counter, self._inner.step(**kwargs):
            yield
        self._counted = True
        counts = counter.counts()
        self.flops, self.memory_bytes = counts.flops, counts.memory_bytes


def device_name(target: str) -> str:
    """The device the settings ran on, named: the GPU's name, or the CPU's architecture and torch's threads."""
    if target == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.cuda.current_device())
    return f"cpu ({platform.machine() or 'unknown'}, {torch.get_num_threads()} threads)"


@contextlib.contextmanager
def _work_folder(workdir: str | Path | None) -> Iterator[Path]:
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
        yield Path(workdir)
        return
    with tempfile.TemporaryDirectory(prefix="remat-profile-") as folder:
        yield Path(folder)


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", label)
