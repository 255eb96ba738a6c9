"""The plan of an ``auto`` recipe, planned once and read by every process of the run.

`remat finetune` plans ``activation_checkpointing: auto`` before anything is built (`plan_recipe_auto`), in the
launcher when it starts workers. The planned recipe's checkpointing setting (and, with ``loss: choose``, its loss)
is written to ``<output_dir>/auto_plan.json`` under a fingerprint of what the plan depends on: the recipe without its
``checkpoint`` section (a requeued job resumes with other ``checkpoint.resume``), the world size, the budget in
bytes on this device and remat's version. A process of the same run reads it instead of planning again (each
torchrun worker, a worker restarted by torchrun, a requeued job); a file of another recipe, world size, budget or
version is planned over. Nothing is passed through the environment or the command line.
"""

from __future__ import annotations

import hashlib
import json
import logging
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from remat._files import read_regular_bytes, write_atomic
from remat.errors import ConfigError
from remat.estimate.choices import LOSS_TARGETS
from remat.planner.api import default_target, plan_recipe_auto, recipe_budget
from remat.distributed.config import AutoCheckpointing
from remat.recipes.config import LossConfig, RecipeConfig
from remat.recipes.loader import with_loss
from remat.recipes.run_safety.output_paths import PLAN_FILE
from remat.units import format_bytes

logger = logging.getLogger(__name__)


def planned_recipe(cfg: RecipeConfig, *, world_size: int, writes: bool) -> RecipeConfig:
    """``cfg`` (an ``auto`` recipe) with its plan: read from the run's plan file when it was planned for this same
    run, else planned here (and written when ``writes``: the launcher, or rank 0)."""
    fingerprint = _fingerprint(cfg, world_size)
    path = Path(cfg.output_dir) / PLAN_FILE
    saved = _read(path, fingerprint)
    if saved is not None:
        planned = _with_saved(cfg, saved)
        logger.info("activation checkpointing 'auto' read from %s (planned for this recipe, world size and budget): "
                    "%s", path, planned.distributed.policy.describe())
        return planned
    planned, plan = plan_recipe_auto(cfg, world_size=world_size)
    logger.info("activation checkpointing 'auto' planned for %s: %s\n%s", format_bytes(plan.budget_bytes),
                plan.policy.describe(), plan.table(candidates=False))
    if writes:
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"fingerprint": fingerprint,
                   "activation_checkpointing": planned.distributed.activation_checkpointing.model_dump(mode="json"),
                   "loss_fn": planned.loss_fn.model_dump(mode="json", by_alias=True)}
        write_atomic(path, json.dumps(payload, indent=2) + "\n", "auto plan file", durable=False)
    return planned


def _fingerprint(cfg: RecipeConfig, world_size: int) -> str:
    budget = recipe_budget(cfg, None, default_target(cfg.distributed.device))
    return recipe_fingerprint(cfg, world_size=world_size, budget_bytes=budget)


def recipe_fingerprint(cfg: RecipeConfig, **facts: Any) -> str:
    """A digest of what a launcher's record for its workers depends on: the recipe without its ``checkpoint``
    section (a requeued job resumes with other ``checkpoint.resume``), remat's version and ``facts`` (JSON values:
    the world size, the budget in bytes)."""
    recipe = cfg.model_dump(mode="json", by_alias=True, exclude={"checkpoint"})
    try:
        remat_version = version("remat")
    except PackageNotFoundError:  # a source tree on the import path, not installed
        remat_version = "source"
    text = json.dumps({"recipe": recipe, **facts, "remat": remat_version}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _read(path: Path, fingerprint: str) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        saved = json.loads(read_regular_bytes(path, "auto plan file", limit=2**20))
    except (ConfigError, ValueError):
        logger.warning("activation checkpointing 'auto': %s does not read as a plan; planning again", path)
        return None
    if not isinstance(saved, dict) or saved.get("fingerprint") != fingerprint:
        return None
    return saved


def _with_saved(cfg: RecipeConfig, saved: dict[str, Any]) -> RecipeConfig:
    try:
        setting = AutoCheckpointing.model_validate(saved["activation_checkpointing"])
        loss_fn = LossConfig.model_validate(saved["loss_fn"])
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"activation checkpointing 'auto': the run's plan file does not validate ({err}); delete "
                          f"{Path(cfg.output_dir) / PLAN_FILE} to plan again") from None
    if loss_fn.target not in (cfg.loss_fn.target, *LOSS_TARGETS.values()):  # the file is data: it names no code
        raise ConfigError(f"activation checkpointing 'auto': the run's plan file names the loss {loss_fn.target!r}, "
                          f"neither the recipe's nor remat's; delete {Path(cfg.output_dir) / PLAN_FILE} to plan again")
    return with_loss(cfg.with_checkpointing(setting), loss_fn.model_dump(by_alias=True))
