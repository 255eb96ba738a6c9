"""What a resume does with a recipe that changed since the checkpoint was saved, decided key by key.

Every difference between the config saved in a checkpoint's ``train_state.json`` and the recipe now running falls in
one class of `RESUME_RULES`:

- **applied**: the new value is used from the next step on, and said so (one info line per change). Optimizer
  hyper-parameters of the same optimizer class go into its param groups; when ``optimizer.lr``, ``lr_scheduler.*`` or
  ``step_scheduler.max_steps`` changed, the learning-rate schedule is rebuilt for the new values and positioned at the
  saved step (so a longer cosine continues downwards from where the new schedule stands, never from the old one's lr).
- **compatible**: how the same work is split changes (``local_batch_size``, ``dp_size``, the number of processes):
  with the same ``global_batch_size`` the data position is re-sharded so the run continues at the same global sample.
- **refused**: the checkpoint's state cannot continue under the new value (the model, the tokenizer, the optimizer
  class, peft, the seed, the data order). One `ConfigError` line names every such key with both values and what to
  do. The training data is compared by content: a fingerprint of the tokenized rows (`remat.data.fingerprint`)
  saved with the state, so other data with the same number of rows is refused and a moved file with the same content
  is accepted. Checkpoints written before fingerprints existed get a warning instead.
- **ignored**: keys that say how this run was started (``checkpoint.resume``, ``output_dir``).

A key the table does not name is *warned*: used as given, with a line saying remat does not know whether changing it
mid-run is safe. The table covers every key of the current schema (a test enforces it), so an unknown key can only come
from a checkpoint of another remat version; refusing it would make such checkpoints impossible to resume for a key the
user may not even be able to set.

The table (`remat.recipes.run_safety.resume_rules`) also defines a run's identity (`identity_digest`): the refused keys, whose
values make a different run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from remat.errors import ConfigError
from remat.recipes.run_safety.resume_rules import (
    _SCHEDULE_KEYS,
    APPLIED,
    COMPATIBLE,
    DATA,
    REFUSED,
    WARNED,
    Rule,
    rule_for,
)

if TYPE_CHECKING:
    import torch

    from remat.data.loader import StatefulBatchIterator
    from remat.recipes.config import RecipeConfig

logger = logging.getLogger(__name__)

_MAX_SHOWN = 4  # refused keys named in the one error line

class _Absent:
    def __repr__(self) -> str:
        return "(not set)"


ABSENT: Any = _Absent()


@dataclass(frozen=True)
class Change:
    """One key whose value differs between the saved config and the current recipe."""

    key: str
    saved: Any
    current: Any
    rule: Rule

    def values(self) -> str:
        return f"{_show(self.saved)} (saved) vs {_show(self.current)} (now)"


def config_differences(saved: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "") -> Iterator[Change]:
    """Every leaf that differs, as dotted keys; a section set on one side only is one change (``peft``)."""
    for name in sorted(set(saved) | set(current), key=str):
        key = f"{prefix}{name}"
        old, new = saved.get(name, ABSENT), current.get(name, ABSENT)
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            yield from config_differences(old, new, prefix=f"{key}.")
        elif old != new:
            yield Change(key, old, new, rule_for(key))


# ------------------------------------------------------------------------------------------------ the plan


@dataclass
class ResumePlan:
    """What resuming from ``checkpoint`` with the current recipe does; made before any state is loaded."""

    checkpoint: Path
    changes: list[Change] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    optimizer_defaults: dict[str, Any] = field(default_factory=dict)
    data_position: tuple[int, int] | None = None
    """(epoch, batch_in_epoch) in the current iterator's batches when the data position is re-sharded."""

    def data_state(self, saved: Mapping[str, Any], batches: StatefulBatchIterator) -> dict[str, Any]:
        """The saved data-iterator state, re-sharded for ``batches`` when the per-step layout changed."""
        if self.data_position is None:
            return dict(saved)
        epoch, batch = self.data_position
        return {**batches.state_dict(), "epoch": epoch, "batch_in_epoch": batch}

    def apply(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any, step: int) -> list[str]:
        """After the state was loaded: put the recipe's applied optimizer values into the param groups and rebuild
        the lr schedule's position when it changed; returns the info lines to print (``self.notes`` + the lr)."""
        keys = {c.key.split(".", 1)[1] for c in self.changes
                if c.key.startswith("optimizer.") and c.rule.kind == APPLIED}
        for group in optimizer.param_groups:
            for name in keys & set(self.optimizer_defaults):
                group[name] = self.optimizer_defaults[name]
        schedule_changed = any(c.key in _SCHEDULE_KEYS or c.key.startswith("lr_scheduler.") for c in self.changes)
        if not schedule_changed or lr_scheduler is None:
            return list(self.notes)
        before = [float(group["lr"]) for group in optimizer.param_groups]
        if "lr" in keys:
            lr_scheduler.base_lrs = [self.optimizer_defaults["lr"]] * len(optimizer.param_groups)
            for group in optimizer.param_groups:
                group["initial_lr"] = self.optimizer_defaults["lr"]
        lrs = [base * factor(step) for base, factor in zip(lr_scheduler.base_lrs, lr_scheduler.lr_lambdas)]
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        lr_scheduler._last_lr = list(lrs)
        return [*self.notes, f"resume: lr schedule rebuilt and positioned at step {step}: step {step + 1} trains "
                             f"with lr {lrs[0]:.4g} (the saved schedule had {before[0]:.4g})"]


def plan_resume(checkpoint: Path, cfg: RecipeConfig, *, data_fingerprint: str | None,
                batches: StatefulBatchIterator, optimizer: torch.optim.Optimizer) -> ResumePlan:
    """Classify every change between the config saved in ``checkpoint`` and ``cfg``; ConfigError (one line naming
    each refused key, both values and what to do) when the saved state cannot continue under ``cfg``."""
    plan = ResumePlan(checkpoint, optimizer_defaults=dict(optimizer.defaults))
    train_state = _read_train_state(checkpoint)
    if train_state is None or not isinstance(train_state.get("config"), Mapping):
        plan.notes.append(f"resume: {checkpoint} records no recipe, so changes to the recipe cannot be checked")
        return plan
    current = cfg.model_dump(mode="json", by_alias=True)
    plan.changes = list(config_differences(_with_defaults(train_state["config"]), current))
    refused = [f"{c.key}: {c.values()}: {c.rule.how}" for c in plan.changes if c.rule.kind == REFUSED]
    refused += _data_refusals(plan, train_state, data_fingerprint, batches)
    if not any(c.key == "step_scheduler.global_batch_size" for c in plan.changes):
        refused += _reshard(plan, train_state.get("data"), batches)
    if refused:
        raise _refusal(checkpoint, refused, cfg)
    for change in plan.changes:
        if change.rule.kind in (APPLIED, COMPATIBLE, WARNED):
            plan.notes.append(f"resume: {change.key}: {_show(change.saved)} -> {_show(change.current)} "
                              f"({change.rule.kind}: {change.rule.how})")
    return plan


def _refusal(checkpoint: Path, refused: list[str], cfg: RecipeConfig) -> ConfigError:
    shown = refused[:_MAX_SHOWN] + ([f"and {len(refused) - _MAX_SHOWN} more"] if len(refused) > _MAX_SHOWN else [])
    return ConfigError(
        f"cannot resume {checkpoint} with this recipe: {'; '.join(shown)}. To continue that run, set these "
        f"back; to train this recipe from scratch, use another output_dir (now {cfg.output_dir!r})")


def early_refusal(candidates: list[Path], cfg: RecipeConfig) -> ConfigError | None:
    """The refusal `plan_resume` would give, known from the recipes alone (the one saved with each checkpoint and
    ``cfg``): when every one of ``candidates`` (the checkpoints a resume could continue from, oldest first) records a
    recipe whose refused keys differ from ``cfg``'s (another model, tokenizer, seed, optimizer class, peft), the error
    for the newest; None when one of them could continue, or one records no recipe (loading it decides). Checked
    before the data is tokenized and the model built."""
    current = cfg.model_dump(mode="json", by_alias=True)
    newest: tuple[Path, list[str]] | None = None
    for checkpoint in reversed(candidates):
        state = _read_train_state(checkpoint)
        if state is None or not isinstance(state.get("config"), Mapping):
            return None
        changes = config_differences(_with_defaults(state["config"]), current)
        refused = [f"{c.key}: {c.values()}: {c.rule.how}" for c in changes if c.rule.kind == REFUSED]
        if not refused:
            return None
        newest = newest or (checkpoint, refused)
    return _refusal(*newest, cfg) if newest is not None else None


def _data_refusals(plan: ResumePlan, train_state: Mapping[str, Any], fingerprint: str | None,
                   batches: StatefulBatchIterator) -> list[str]:
    """The training data by content: the saved fingerprint (or, for older checkpoints, the row count)."""
    keys = [c for c in plan.changes if c.rule.kind == DATA]
    plan.changes = [c for c in plan.changes if c.rule.kind != DATA]
    saved_rows = (train_state.get("data") or {}).get("num_rows")
    saved = train_state.get("data_fingerprint")
    named = "".join(f"; {c.key}: {c.values()}" for c in keys)
    if saved is not None and fingerprint is not None and saved.split(":")[0] == fingerprint.split(":")[0]:
        if saved != fingerprint:
            return [f"dataset: the tokenized training data differs from the saved run's (fingerprint "
                    f"{_short(saved)} vs {_short(fingerprint)}, {saved_rows} vs {batches.num_rows} rows{named}): the "
                    "saved data position and training belong to that data"]
        plan.notes += [f"resume: {c.key}: {_show(c.saved)} -> {_show(c.current)} (the tokenized data is identical, "
                       f"fingerprint {_short(fingerprint)})" for c in keys]
        return []
    if saved_rows is not None and saved_rows != batches.num_rows:
        return [f"dataset: the training data has {batches.num_rows} rows, the saved run's had {saved_rows}{named}: "
                "the saved data position belongs to that data"]
    plan.notes.append(f"resume: {plan.checkpoint} predates data fingerprints, so the training data cannot be "
                      f"checked to be the same (only its row count, {batches.num_rows}){named}")
    return []


def _reshard(plan: ResumePlan, saved: Mapping[str, Any] | None, batches: StatefulBatchIterator) -> list[str]:
    """Re-express the saved data position in the current iterator's batches when the rows per iterator batch
    (local batch x data-parallel ranks) changed; the recipe's global batch is checked as a config key."""
    if not saved or saved.get("global_batch_size") in (None, batches.global_batch_size):
        return []
    old, new = int(saved["global_batch_size"]), batches.global_batch_size
    row = int(saved["batch_in_epoch"]) * old
    if row % new:
        return [f"the data position (row {row} of epoch {saved['epoch']}, in batches of {old} rows) is not a "
                f"multiple of this run's {new} rows per batch (local_batch_size x data-parallel ranks): resume with "
                f"the saved layout for one more step, or keep {old} rows per batch"]
    plan.data_position = (int(saved["epoch"]), row // new)
    note = (f"resume: data re-sharded from batches of {old} rows to {new} (local_batch_size "
            f"{batches.batch_size} x {batches.world_size} data-parallel ranks): continuing at row {row} of epoch "
            f"{saved['epoch']}, the same global sample")
    per_epoch_old = (batches.num_rows // old) * old if batches.drop_last else batches.num_rows
    per_epoch_new = (batches.num_rows // new) * new if batches.drop_last else batches.num_rows
    if per_epoch_old != per_epoch_new:
        note += (f"; an epoch now uses {per_epoch_new} of the {batches.num_rows} rows (was {per_epoch_old}), "
                 "so later epochs end at another row")
    plan.notes.append(note)
    return []


#: The largest train_state.json read to compare recipes (a saved one is a few kB: the recipe and counters).
_TRAIN_STATE_LIMIT = 16 * 2**20


def _read_train_state(checkpoint: Path) -> dict[str, Any] | None:
    from remat._files import read_regular_bytes
    from remat.training_state.layout import TRAIN_STATE_FILE

    try:  # read before the checkpoint is verified (`early_refusal`): a regular file, not through a link, bounded
        state = json.loads(read_regular_bytes(checkpoint / TRAIN_STATE_FILE, "checkpoint:", limit=_TRAIN_STATE_LIMIT,
                                              follow_symlinks=False))
    except (OSError, ValueError, RecursionError, ConfigError):
        return None  # loading the checkpoint reports it
    return state if isinstance(state, dict) else None


def _with_defaults(saved: Mapping[str, Any]) -> Mapping[str, Any]:
    """The saved config with today's defaults filled in (keys added since it was saved are not changes); as saved
    when it no longer validates (e.g. a model directory that moved)."""
    from remat.recipes.config import RecipeConfig

    try:
        return RecipeConfig.model_validate(dict(saved)).model_dump(mode="json", by_alias=True)
    except (ValidationError, ConfigError):
        return saved


def _short(fingerprint: str) -> str:
    return fingerprint.split(":")[-1][:12]


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if value is not ABSENT else repr(value)
    return text if len(text) <= 160 else text[:157] + "..."
