"""Entry points: `plan_activation_checkpointing` (Python), `plan_recipe` / `plan_recipe_auto` (recipes with
``distributed.activation_checkpointing: auto``, planned after the recipe is validated and before it is built)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat._child import call_in_child, child_call, needs_fresh_process
from remat.errors import ConfigError
from remat.estimate.api import ModelLike, recipe_step, resolve_model
from remat.estimate.run import SimulatedRun
from remat.estimate.settings import StepSettings
from remat.models import ModelConfig
from remat.checkpointing.budget import BudgetLike, MemoryBudget, parse_budget
from remat.planner.calibration import calibrated_rates
from remat.planner.loss_choice import LossChooser, check_choosable, check_loss_choice, recipe_loss_fn
from remat.planner.planner import Planner
from remat.planner.result import ActivationPlan
from remat.planner.spelling import PYTHON, Spelling
from remat.recipes.build import lora_section
from remat.recipes.config import RecipeConfig
from remat.recipes.loader import load_recipe, with_loss

logger = logging.getLogger(__name__)

_BUDGET_KEY = "distributed.activation_checkpointing.memory_budget"


def plan_activation_checkpointing(
    model_or_recipe: RecipeConfig | nn.Module | ModelLike,
    *,
    memory_budget: BudgetLike = None,
    example_batch: torch.Tensor | Mapping[str, torch.Tensor] | None = None,
    target: str | None = None,
    flops_per_second: float | None = None,
    all_candidates: bool = False,
    loss_choice: str = "keep",
    **settings: Any,
) -> ActivationPlan:
    """The per-layer checkpointing plan with the least predicted recompute whose predicted step peak fits
    ``memory_budget``; pass it to `remat.apply_activation_checkpointing(model, plan)`.

    ``model_or_recipe``: a `RecipeConfig` or a recipe's YAML path (its step is planned), a model (its config and
    parameter dtype are planned; weights are never read), or what `remat.estimate_memory` takes (a preset name, a
    ``config.json``, a transformers config). ``example_batch`` (token ids ``[batch, seq]`` or a mapping with
    ``input_ids``) gives the shape, or ``batch_size=`` / ``seq_length=``; other keyword arguments are
    `remat.estimate.StepSettings` fields (``loss="fused"``, ``optimizer=...``, ``strategy="fsdp2"``,
    ``world_size=8``, ``autocast="bfloat16"``). ``memory_budget``: bytes, a size (``"40GiB"``), a fraction of the
    GPU's memory, or None for the GPU's memory minus a margin (a budget is required for the CPU). ``target``:
    ``"cuda"`` or ``"cpu"`` (default: cuda when a GPU is visible). ``all_candidates`` prices every uniform policy
    for ``plan.candidates`` (by default only those that could beat the chosen plan). ``loss_choice="choose"``
    plans for the plain and the fused loss and returns the faster plan that fits (``plan.loss`` names it;
    `remat.planner.loss_choice`); ``"keep"`` plans for the loss given (``loss=``, default plain).
    """
    check_loss_choice(loss_choice)
    settings.update(_batch_shape(example_batch))
    if isinstance(model_or_recipe, (str, Path)) and Path(model_or_recipe).suffix in (".yaml", ".yml"):
        model_or_recipe = load_recipe(model_or_recipe)
    if isinstance(model_or_recipe, RecipeConfig):
        return plan_recipe(model_or_recipe, budget=memory_budget, target=target, flops_per_second=flops_per_second,
                           all_candidates=all_candidates, loss_choice=loss_choice, **settings)
    model, step, budget = _model_step(model_or_recipe, memory_budget, target, settings)
    return plan_model_step(model, step, budget, flops_per_second=flops_per_second, all_candidates=all_candidates,
                           loss_choice=loss_choice)


@child_call
def plan_model_step(model: ModelConfig, step: StepSettings, budget: int, *, flops_per_second: float | None = None,
                    all_candidates: bool = False, loss_choice: str = "keep",
                    spelling: Spelling = PYTHON) -> ActivationPlan:
    """`plan_activation_checkpointing` once its arguments are resolved: the plan for ``step`` of ``model`` under
    ``budget`` bytes. From a process that joined a process group, a step with FSDP2 or context parallelism is
    planned in a child process (`remat._child`)."""
    if needs_fresh_process(step.strategy, step.cp_size):
        return call_in_child(plan_model_step, model, step, budget,  # type: ignore[no-any-return]
                             flops_per_second=flops_per_second, all_candidates=all_candidates,
                             loss_choice=loss_choice, spelling=spelling)
    if check_loss_choice(loss_choice) == "choose":
        check_choosable(step.loss)  # before the recipe is built (and its loss class resolved)
    recipe, run = dataclasses.replace(step, policy="none").to_recipe(model), step.run()

    def planner_for(step_recipe: RecipeConfig) -> Planner:
        return Planner(step_recipe, run, flops_per_second, spelling=spelling)

    planner: Planner | LossChooser = LossChooser(recipe, planner_for) if loss_choice == "choose" else planner_for(
        recipe)
    return planner.plan(budget, all_candidates=all_candidates)


def planner_for_model(model: nn.Module | ModelLike, *, memory_budget: BudgetLike = None, target: str | None = None,
                      flops_per_second: float | None = None, spelling: Spelling = PYTHON,
                      **settings: Any) -> tuple[Planner, int]:
    """The `Planner` of a model's step (``settings``: `remat.estimate.StepSettings` fields) and the budget in bytes,
    as `plan_activation_checkpointing` makes them; for a caller that plans again later with the same planner (its
    block measurements and simulated traces are kept), e.g. after an out-of-memory error in a Trainer's step.
    ``spelling``: how its errors name what would help (`remat.planner.spelling`)."""
    config, step, budget = _model_step(model, memory_budget, target, settings)
    return Planner.from_settings(config, step, flops_per_second, spelling=spelling), budget


def _model_step(model: nn.Module | ModelLike, memory_budget: BudgetLike, target: str | None,
                settings: dict[str, Any]) -> tuple[ModelConfig, StepSettings, int]:
    if isinstance(model, nn.Module):
        settings.setdefault("dtype", _dtype_name(model))
        settings.setdefault("peft", lora_section(model, caller="plan_activation_checkpointing"))
        model = model.config
    step = StepSettings(target=target or default_target("auto"), **settings)  # type: ignore[arg-type]
    budget = parse_budget(memory_budget, device_bytes=device_bytes(step.target), key="memory_budget")
    return resolve_model(model), step, budget


def plan_recipe_auto(cfg: RecipeConfig, *, world_size: int | None = None) -> tuple[RecipeConfig, ActivationPlan]:
    """Plan a recipe's ``activation_checkpointing: auto`` (`remat.recipes.config.AutoCheckpointing`) for its
    ``memory_budget`` (``world_size``: the processes the launch will start, for a recipe without
    ``distributed.dp_size``); returns the recipe with the plan filled in (and, with ``loss: choose``, the loss the
    planner chose), and the plan. The recipe is copied, not validated again."""
    auto = cfg.distributed.auto
    if auto is None:
        raise ConfigError(f"distributed.activation_checkpointing: got {cfg.distributed.policy.describe()!r}; "
                          "plan_recipe_auto plans a recipe with activation_checkpointing: auto")
    options = {"world_size": world_size} if world_size and cfg.distributed.strategy != "single" else {}
    plan = plan_recipe(cfg, loss_choice=auto.loss, **options)
    planned = cfg.with_checkpointing(auto.planned(plan.policy))
    if auto.loss == "choose":
        loss_fn = recipe_loss_fn(cfg.loss_fn.target, cfg.loss_fn.kwargs, plan.loss)
        planned = with_loss(planned, loss_fn)
    return planned, plan


@child_call
def plan_recipe(cfg: RecipeConfig, *, budget: BudgetLike = None, target: str | None = None,
                flops_per_second: float | None = None, all_candidates: bool = False, loss_choice: str = "keep",
                **settings: Any) -> ActivationPlan:
    """The plan for the step ``cfg`` trains (its policy ignored) under ``budget`` (default: the recipe's
    ``activation_checkpointing.memory_budget``); ``loss_choice="choose"`` also chooses the loss (`loss_chooser_for_recipe`).
    From a process that joined a process group, a step with FSDP2 or context parallelism is planned in a child
    process (`remat._child`)."""
    target = target or default_target(cfg.distributed.device)
    if needs_fresh_process(cfg.distributed.strategy, cfg.distributed.cp_size):
        return call_in_child(plan_recipe, cfg,  # type: ignore[no-any-return]
                             budget=recipe_budget(cfg, budget, target), target=target,
                             flops_per_second=flops_per_second, all_candidates=all_candidates,
                             loss_choice=loss_choice, **settings)
    if check_loss_choice(loss_choice) == "choose":
        planner: Planner | LossChooser = loss_chooser_for_recipe(cfg, target=target,
                                                                 flops_per_second=flops_per_second, **settings)
    else:
        planner = planner_for_recipe(cfg, target=target, flops_per_second=flops_per_second, **settings)
    return planner.plan(recipe_budget(cfg, budget, target), all_candidates=all_candidates)


def loss_chooser_for_recipe(cfg: RecipeConfig, **options: Any) -> LossChooser:
    """A `LossChooser` for the step ``cfg`` trains, with the plain and with the fused loss (``options`` as for
    `planner_for_recipe`), the recipe's loss arguments carried over."""
    recipe, run, pricing = _recipe_planning(cfg, **options)
    return LossChooser(recipe, lambda step_recipe: Planner(step_recipe, run, **pricing))


def planner_for_recipe(cfg: RecipeConfig, **options: Any) -> Planner:
    """A `Planner` for the step ``cfg`` trains on ``target`` (default: the device the recipe would train on).
    Recompute is priced at ``flops_per_second`` (and ``memory_bytes_per_second``: `remat.planner.timing`), else at
    the rates in the recipe's ``activation_checkpointing.calibration`` (`remat.planner.calibration`), else at the
    target's default throughput. Other ``options``: ``world_size`` and `remat.estimate.StepSettings` fields
    overriding the recipe's (`remat.estimate.api.recipe_step`)."""
    recipe, run, pricing = _recipe_planning(cfg, **options)
    return Planner(recipe, run, **pricing)


def _recipe_planning(cfg: RecipeConfig, *, target: str | None = None, flops_per_second: float | None = None,
                     memory_bytes_per_second: float | None = None,
                     **options: Any) -> tuple[RecipeConfig, SimulatedRun, dict[str, float | None]]:
    """The step ``cfg`` trains (`remat.estimate.api.recipe_step`) and the rates its recompute is priced at."""
    target = target or default_target(cfg.distributed.device)
    calibration = cfg.distributed.auto.calibration if cfg.distributed.auto is not None else None
    if flops_per_second is None and calibration is not None:
        flops_per_second, memory_bytes_per_second = calibrated_rates(
            calibration, target, key="distributed.activation_checkpointing.calibration")
        logger.info("planner: recompute priced at %.3g FLOP/s%s from %s", flops_per_second,
                    f" and {memory_bytes_per_second:.3g} B/s for memory-bound ops" if memory_bytes_per_second else "",
                    calibration)
    recipe, run = recipe_step(cfg, target=target, **options)
    return recipe, run, {"flops_per_second": flops_per_second, "memory_bytes_per_second": memory_bytes_per_second}


def recipe_budget(cfg: RecipeConfig, budget: BudgetLike, target: str, *, key: str = "memory_budget") -> int:
    """``budget`` (or the recipe's ``activation_checkpointing.memory_budget``) in bytes for ``target``; an error names ``key``
    (how the caller spelled the budget: ``memory_budget=``, ``--budget``) or the recipe key."""
    auto = cfg.distributed.auto
    if budget is None:
        return (auto.memory_budget if auto is not None else MemoryBudget()).resolve(device_bytes(target),
                                                                                  key=_BUDGET_KEY)
    return parse_budget(budget, device_bytes=device_bytes(target), key=key)


def default_target(device: str) -> str:
    """What a recipe's ``distributed.device`` trains on here: ``cpu``, or ``cuda`` (``auto`` with a GPU visible)."""
    if device == "cpu":
        return "cpu"
    return "cuda" if device == "cuda" or torch.cuda.is_available() else "cpu"


def device_bytes(target: str) -> int | None:
    """The memory of the GPU this process would use, when planning for ``cuda`` with one visible; else None."""
    if target != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def _batch_shape(example_batch: torch.Tensor | Mapping[str, torch.Tensor] | None) -> dict[str, int]:
    if example_batch is None:
        return {}
    ids = example_batch.get("input_ids") if isinstance(example_batch, Mapping) else example_batch
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ConfigError("example_batch: allowed: token ids of shape [batch, seq] or a mapping with such "
                          f"'input_ids'; got {type(ids).__name__} {tuple(getattr(ids, 'shape', ()))}")
    return {"batch_size": int(ids.shape[0]), "seq_length": int(ids.shape[1])}


def _dtype_name(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return str(param.dtype).removeprefix("torch.") if param is not None else "float32"
