"""The ``distributed`` section: the parallelism of a run and its activation checkpointing, as one validated config.

`DistributedConfig` holds every rule between its keys (checked once, when it is validated); the recipe nests it
under ``distributed``, and `remat.DistributedSetup` is built from it (`DistributedSetup.from_config`; the keyword
``DistributedSetup.build(...)`` validates one first). Needs no torch: the launcher reads it before any worker starts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    NonNegativeInt,
    PlainSerializer,
    PlainValidator,
    PositiveInt,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from remat._logs import warn_once
from remat._validation import validation_lines
from remat.checkpointing.budget import MemoryBudget
from remat.checkpointing.policy import AUTO, CheckpointPolicy, parse_policy
from remat.config_base import StrictModel
from remat.distributed.choices import DEVICE_CHOICES, MIXED_PRECISION, STRATEGIES
from remat.distributed.layout import check_strategy_rules, world_layout
from remat.errors import ConfigError

logger = logging.getLogger(__name__)


_POLICY_KEY = "distributed.activation_checkpointing"

AUTO_KEYS: tuple[str, ...] = ("memory_budget", "max_replans", "relax_after_steps", "calibration", "loss")
"""The planner's keys: `AutoCheckpointing`'s fields, read only with ``activation_checkpointing: {mode: auto, ...}``."""

LEGACY_PLANNER_KEYS: dict[str, str] = {"memory_budget": "memory_budget", "max_replans": "max_replans",
                                       "relax_after_steps": "relax_after_steps",
                                       "planner_calibration": "calibration", "planner_loss": "loss"}
"""The planner's keys as they were spelled loose in ``distributed`` (still read, with a deprecation warning): old
name -> key of the ``auto`` mapping."""


def _parse_budget(value: Any) -> MemoryBudget:
    return MemoryBudget.parse(value, key=f"{_POLICY_KEY}.memory_budget")


TypedBudget = Annotated[MemoryBudget, PlainValidator(_parse_budget), PlainSerializer(lambda b: b.to_value())]
"""``memory_budget``: bytes, a size (``40GiB``), a fraction of the device's memory (0.8) or null (the default),
parsed when the recipe is validated (`remat.checkpointing.budget.MemoryBudget`); a fraction or the default is
resolved against the device when the run starts."""


def _parse_plan(value: Any) -> CheckpointPolicy:
    return parse_policy(value, key=f"{_POLICY_KEY}.plan")


PlannedPolicy = Annotated[CheckpointPolicy, PlainValidator(_parse_plan), PlainSerializer(lambda p: p.to_dict())]


class AutoCheckpointing(StrictModel):
    """``activation_checkpointing: auto`` (or ``{mode: auto, memory_budget: 40GiB, ...}``): the planner
    (`remat.planner`, above the recipe) chooses the per-layer policy with the least recompute whose predicted peak
    fits ``memory_budget`` per rank, and the run re-plans and relaxes it from what its steps measure
    (`remat.adaptation`).

    ``plan`` is the policy the planner chose for this run: `remat finetune` and `remat plan` fill it in before
    anything is built (a recipe file leaves it out), and a run's saved config keeps it, so "this policy came from
    auto" is part of the recipe rather than something the processes are told apart.
    """

    mode: Literal["auto"] = "auto"
    memory_budget: TypedBudget = Field(default_factory=MemoryBudget)
    max_replans: NonNegativeInt = 3
    """How many times a run may re-plan when a step's peak exceeds ``memory_budget`` or raises an out-of-memory
    error (the step is retried each time; `remat.adaptation.retry`); 0 turns re-planning off."""
    relax_after_steps: PositiveInt | None = 100
    """With ``max_replans`` >= 1: after this many steps in a row well under ``memory_budget``, plan again for the
    room measured and swap in a plan with less recompute when one is predicted faster and to fit
    (`remat.adaptation.relax_watch`); null: never relax."""
    calibration: str | None = None
    """A JSON file of `remat profile --write-calibration`: the measured throughput the planner prices recompute at."""
    loss: Literal["keep", "choose"] = "keep"
    """``choose`` lets the planner pick the plain or the fused loss (``loss_fn._target_``), the faster plan that
    fits (`remat.planner.loss_choice`); ``keep`` plans for the recipe's own loss."""
    plan: PlannedPolicy | None = None

    def planned(self, policy: CheckpointPolicy) -> AutoCheckpointing:
        """This setting with ``plan`` set to ``policy`` (a copy: nothing else is validated again)."""
        return self.model_copy(update={"plan": policy})


def asks_for_auto(value: Any) -> bool:
    """Whether a value of ``distributed.activation_checkpointing`` asks for the planner: ``auto`` (any case), a
    mapping whose ``mode`` is ``auto``, or an `AutoCheckpointing`. Needs no torch (the launcher asks before it loads)."""
    if isinstance(value, AutoCheckpointing):
        return True
    if isinstance(value, str):
        return value.strip().lower() == AUTO
    return isinstance(value, Mapping) and isinstance(value.get("mode"), str) and value["mode"].strip().lower() == AUTO


def _auto_or_policy(value: Any) -> str:
    return "tagged[auto]" if asks_for_auto(value) else "tagged[policy]"


def _auto_mapping(value: Any) -> Any:
    if isinstance(value, str) and asks_for_auto(value):
        return {"mode": AUTO}
    if isinstance(value, Mapping) and asks_for_auto(value):
        return {**value, "mode": AUTO}
    return value


def _parse_checkpointing(value: Any) -> CheckpointPolicy:
    if isinstance(value, Mapping) and not isinstance(value, CheckpointPolicy):
        planner_keys = [key for key in value if key in AUTO_KEYS or key == "plan"]
        if planner_keys:
            raise ConfigError(
                f"{_POLICY_KEY}.{planner_keys[0]}: a key of the planner, read only with mode auto (got mode "
                f"{value.get('mode', 'full')!r}); remove it, or plan: {_POLICY_KEY}: {{mode: auto, "
                f"{planner_keys[0]}: ...}}")
    return parse_policy(value, key=_POLICY_KEY)


TypedPolicy = Annotated[
    CheckpointPolicy,
    PlainValidator(_parse_checkpointing),
    PlainSerializer(lambda policy: policy.to_dict()),
]
"""A pinned ``distributed.activation_checkpointing``: any spelling `remat.checkpointing.parse_policy` accepts (true,
"full", a mapping, ...), parsed once when the recipe is validated and carried as a `CheckpointPolicy` from then on
(written back as its mapping by model_dump, e.g. the config saved with training state)."""

CheckpointingSetting = Annotated[
    Annotated[Annotated[AutoCheckpointing, Tag("tagged[auto]")] | Annotated[TypedPolicy, Tag("tagged[policy]")],
              Discriminator(_auto_or_policy)],
    BeforeValidator(_auto_mapping),
]
"""``distributed.activation_checkpointing``: a pinned policy (`TypedPolicy`) or ``auto`` (`AutoCheckpointing`)."""


class DistributedConfig(StrictModel):
    """``distributed``: the parallelism strategy and activation checkpointing (the seed documents' keys).

    `remat.DistributedSetup.from_config` builds a run's parallelism from it (``DistributedSetup.build`` takes the
    same keys as keyword arguments). ``mixed_precision`` and ``cpu_offload`` apply to FSDP2 (its ``MixedPrecisionPolicy`` /
    ``CPUOffloadPolicy``); ``fsdp_reduce_every_micro_batch: false`` defers FSDP2's gradient reduce-scatter to the
    last micro-batch of a step (less communication, unsharded gradients held during accumulation). ``device``:
    ``auto`` trains on CUDA device ``LOCAL_RANK`` when the node has a GPU per process (else on the CPU, with a
    warning if there are GPUs, but too few), ``cpu`` on the CPU (gloo), ``cuda`` on the GPUs (NCCL; an error when
    there are fewer GPUs than processes per node).

    ``activation_checkpointing: auto`` (`AutoCheckpointing`, with the planner's keys nested under it) asks the
    planner for the per-layer policy with the least recompute that fits a memory budget; `remat finetune` plans it
    before anything is built.
    """

    strategy: Literal[STRATEGIES] = "single"  # type: ignore[valid-type]
    device: Literal[DEVICE_CHOICES] = "auto"  # type: ignore[valid-type]
    activation_checkpointing: CheckpointingSetting = Field(default_factory=lambda: parse_policy(False))
    dp_size: PositiveInt | None = None
    tp_size: PositiveInt = 1
    cp_size: PositiveInt = 1
    mixed_precision: Literal[MIXED_PRECISION] | None = None  # type: ignore[valid-type]
    cpu_offload: bool = False
    fsdp_reduce_every_micro_batch: bool = True
    init_timeout_s: float = Field(default=600.0, ge=1.0)
    """Joining the process group must finish within this many seconds (a rank that never arrives is an error); at
    least 1 s: below that no group forms (torchrun's stack trace, in the trial)."""
    timeout_s: float | None = Field(default=None, ge=1.0)
    """The collectives' time limit; null: torch's default (30 minutes for gloo, 10 for NCCL); at least 1 s."""

    @field_validator("init_timeout_s", "timeout_s", mode="before")
    @classmethod
    def _seconds_not_a_flag(cls, value: Any) -> Any:
        if isinstance(value, bool):  # pydantic would read true as 1 second
            raise ValueError("true or false is not a number of seconds; allowed: a number, at least 1")
        return value

    @model_validator(mode="before")
    @classmethod
    def _planner_keys_moved(cls, data: Any) -> Any:
        """The planner's keys written loose in ``distributed`` (their spelling before they were nested under
        ``auto``): moved under it with a one-line deprecation warning; an error naming both keys without ``auto``."""
        if not isinstance(data, Mapping) or not any(key in data for key in LEGACY_PLANNER_KEYS):
            return data
        data = dict(data)
        moved = {LEGACY_PLANNER_KEYS[key]: data.pop(key) for key in list(data) if key in LEGACY_PLANNER_KEYS}
        old = next(key for key, new in LEGACY_PLANNER_KEYS.items() if new in moved)
        policy = data.get("activation_checkpointing", False)
        if not asks_for_auto(policy):
            shown = policy if not isinstance(policy, CheckpointPolicy) else policy.describe()
            raise ConfigError(f"distributed.{old}: a key of the planner, read only with {_POLICY_KEY}: auto (got "
                              f"{shown!r}); remove it, or plan: {_POLICY_KEY}: {{mode: auto, "
                              f"{LEGACY_PLANNER_KEYS[old]}: ...}}")
        nested = _auto_mapping(policy)
        if isinstance(nested, AutoCheckpointing):
            nested = nested.model_dump(mode="json")
        twice = sorted(set(moved) & set(nested))
        if twice:
            raise ConfigError(f"{_POLICY_KEY}.{twice[0]}: given twice, also as the older loose key in distributed; "
                              "keep the nested one")
        data["activation_checkpointing"] = {**nested, **moved}
        warn_once(logger, "distributed.%s: deprecated spelling; write the planner's keys under the policy: "
                  "%s: {mode: auto, %s}", old, _POLICY_KEY,
                  ", ".join(f"{key}: {value}" for key, value in moved.items()))
        return data

    @model_validator(mode="after")
    def _strategy_rules(self) -> DistributedConfig:
        check_strategy_rules(self.strategy, self.dp_size, self.tp_size, self.cp_size, self.mixed_precision,
                             self.cpu_offload)
        return self

    @classmethod
    def from_settings(cls, **settings: Any) -> DistributedConfig:
        """The section from keyword settings (`DistributedSetup.build`'s), validated as a recipe's is: a
        `ConfigError` whose lines name each ``distributed.<key>`` that is wrong and what is allowed."""
        try:
            return cls.model_validate(settings)
        except ValidationError as err:
            raise ConfigError("\n".join(validation_lines(err, cls, prefix="distributed"))) from None

    def data_parallel_size(self, world_size: int) -> int:
        """``dp_size`` on ``world_size`` processes (derived when left out); `ConfigError` naming the key when the
        sizes do not fit that many (the rules that hold for any number of processes were checked on validation)."""
        return world_layout(self.strategy, self.dp_size, self.tp_size, self.cp_size, world_size=world_size)

    @property
    def auto(self) -> AutoCheckpointing | None:
        """The ``auto`` setting with the planner's keys, or None for a pinned policy."""
        setting = self.activation_checkpointing
        return setting if isinstance(setting, AutoCheckpointing) else None

    @property
    def policy(self) -> CheckpointPolicy:
        """The policy in force: the pinned one, or the plan ``auto`` chose; `ConfigError` for ``auto`` not planned
        yet (`remat finetune` and `remat plan` plan it; in Python, `remat.planner.plan_recipe_auto`)."""
        setting = self.activation_checkpointing
        if not isinstance(setting, AutoCheckpointing):
            return setting
        if setting.plan is None:
            raise ConfigError(f"{_POLICY_KEY}: 'auto' is not planned yet; remat finetune plans it before the build "
                              "(in Python: remat.planner.plan_recipe_auto(cfg))")
        return setting.plan
