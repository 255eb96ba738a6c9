"""The fine-tuning recipe schema: one strict pydantic model per YAML section.

Component sections (``model``, ``tokenizer``, ``dataset``) are owned by their packages; this module composes them and
adds the sections that only the recipe uses. Every section rejects unknown keys; ``remat.recipes.loader`` turns
validation errors into messages that name the dotted key, the given value and what is allowed.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from pathlib import PurePath
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    NonNegativeInt,
    PlainSerializer,
    PlainValidator,
    PositiveFloat,
    PositiveInt,
    Tag,
    field_validator,
    model_validator,
)

from remat._logs import warn_once
from remat.checkpointing.budget import MemoryBudget
from remat.checkpointing.policy import AUTO, CheckpointPolicy, parse_policy
from remat.config_base import StrictModel
from remat.data.config import DatasetConfig, TokenizerConfig
from remat.distributed.choices import DEVICE_CHOICES, MIXED_PRECISION, STRATEGIES
from remat.distributed.layout import check_strategy_rules
from remat.errors import ConfigError
from remat.models.config import ModelConfig

logger = logging.getLogger(__name__)


class TargetConfig(StrictModel):
    """A section naming a class or function to build (``_target_``) plus its keyword arguments.

    Keyword arguments are the extra keys of the section; they are checked against the target's signature when the
    recipe is validated (see ``remat.recipes.targets``), so a typo is caught before anything heavy happens.
    """

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    target: str = Field(alias="_target_")

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class OptimizerConfig(TargetConfig):
    """``optimizer``: any ``torch.optim`` optimizer (or an allowed ``_target_``); keys other than ``_target_`` are its
    keyword arguments."""

    target: str = Field(default="torch.optim.AdamW", alias="_target_")

    @model_validator(mode="after")
    def _check_hyperparameters(self) -> OptimizerConfig:
        """The usual hyper-parameters, checked when the recipe is read (not after the model is built)."""
        for name, value in self.kwargs.items():
            check = _OPTIMIZER_VALUE_CHECKS.get(name)
            if check is not None and not check[0](value):
                raise ConfigError(f"optimizer.{name}: got {value!r}; allowed: {check[1]}")
        return self


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_OPTIMIZER_VALUE_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lr": (lambda v: _number(v) and v > 0, "a positive finite number, e.g. 3e-4"),
    "eps": (lambda v: _number(v) and v > 0, "a positive finite number, e.g. 1e-8"),
    "weight_decay": (lambda v: _number(v) and v >= 0, "a finite number >= 0"),
    "momentum": (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "betas": (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(_number(b) and 0 <= b < 1 for b in v),
              "two numbers in [0, 1), e.g. [0.9, 0.999]"),
}


class LossConfig(TargetConfig):
    """``loss_fn``: ``remat.loss.MaskedCrossEntropy`` (logits) or ``remat.loss.FusedLinearCrossEntropy`` (hidden
    states + output weight, never materialising the logits). The loss class declares what it consumes
    (`remat.loss.loss_input`), and the model's outputs follow from it."""

    target: str = Field(default="remat.loss.MaskedCrossEntropy", alias="_target_")


class StepSchedulerConfig(StrictModel):
    """``step_scheduler``: batch sizes, how long to train, and how often to validate and checkpoint.

    ``global_batch_size`` = ``local_batch_size`` x data-parallel size x gradient-accumulation steps.
    """

    global_batch_size: PositiveInt = 8
    local_batch_size: PositiveInt = 8
    max_steps: PositiveInt = 100
    num_epochs: PositiveInt | None = None
    """Passes over the training rows: ``max_steps`` becomes epochs x (rows // global_batch_size), derived once the
    dataset is built (and said); a ``max_steps`` written too wins."""
    val_every_steps: PositiveInt | None = None
    val_batches: PositiveInt | None = None
    ckpt_every_steps: PositiveInt | None = None

    @property
    def steps_from_epochs(self) -> bool:
        """``max_steps`` is to be derived from ``num_epochs`` (no ``max_steps`` was written)."""
        return self.num_epochs is not None and "max_steps" not in self.model_fields_set

    def accumulation_steps(self, dp_size: int, world_size: int | None = None) -> int:
        """Micro-batches per optimizer step on ``dp_size`` data-parallel ranks (of ``world_size`` processes, said
        in the error): ``global_batch_size / (local_batch_size x dp_size)``; one `ConfigError` when that is not an
        integer. The one place this arithmetic is done (the launch, the estimate and its keyword settings)."""
        per_step = self.local_batch_size * dp_size
        if self.global_batch_size % per_step:
            of = f", of {world_size} processes" if world_size is not None else ""
            raise ConfigError(
                f"step_scheduler.global_batch_size: {self.global_batch_size} is not local_batch_size "
                f"({self.local_batch_size}) x dp_size ({dp_size}{of}) x an integer number of accumulation steps; "
                f"allowed: a multiple of {per_step}")
        return self.global_batch_size // per_step

    @model_validator(mode="after")
    def _batch_sizes_divide(self) -> StepSchedulerConfig:
        if self.global_batch_size % self.local_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of local_batch_size "
                f"({self.local_batch_size}) x data-parallel size; gradient accumulation covers the rest"
            )
        return self


class LRSchedulerConfig(StrictModel):
    """``lr_scheduler``: linear warmup, then cosine (or linear, or constant) decay to ``min_lr_ratio`` x lr."""

    warmup_steps: int = Field(default=0, ge=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    decay_steps: PositiveInt | None = None


class ClipGradNormConfig(StrictModel):
    """``clip_grad_norm``: clip the global gradient norm; ``max_norm: null`` only measures it."""

    max_norm: PositiveFloat | None = 1.0


class TrainingConfig(StrictModel):
    """``training``: what a step whose loss or gradient norm is NaN or infinite does. Its update is never applied
    (the check runs before the optimizer step); ``on_nonfinite: stop`` then stops the run (exit 2, nothing saved),
    ``skip`` goes on with the next batch until more than ``max_nonfinite_steps`` such steps come in a row."""

    on_nonfinite: Literal["skip", "stop"] = "stop"
    max_nonfinite_steps: PositiveInt = 3


COMPILE_BACKENDS: tuple[str, ...] = ("inductor", "aot_eager", "eager", "cudagraphs")
COMPILE_MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class CompileConfig(StrictModel):
    """``compile``: ``torch.compile`` of each decoder block after activation checkpointing wraps it (and before
    FSDP2 / DDP wrap the model), as TorchTitan compiles per block: ``backend``, ``mode``, ``fullgraph`` and
    ``dynamic`` are ``torch.compile``'s. Off by default. The estimate and the planner model the eager blocks."""

    enabled: bool = False
    backend: Literal["inductor", "aot_eager", "eager", "cudagraphs"] = "inductor"
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = None
    fullgraph: bool = False
    dynamic: bool | None = None


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

    Every key is an argument of ``remat.DistributedSetup.build`` (``activation_checkpointing`` as the policy in
    force, `policy`). ``mixed_precision`` and ``cpu_offload`` apply to FSDP2 (its ``MixedPrecisionPolicy`` /
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


class CheckpointConfig(StrictModel):
    """``checkpoint``: where and how training state is saved, and whether a run resumes.

    ``resume``: ``auto`` continues from the newest checkpoint in ``checkpoint_dir`` that verifies (content hashes)
    and loads, falling back past broken ones and stopping with one error when checkpoints exist but none does;
    ``never`` starts fresh (refusing to overwrite existing checkpoints); ``restart`` moves existing checkpoints into
    ``checkpoint_dir/.superseded-<time>/`` and starts fresh (``remat finetune --restart``); or a path to a ``step_N``
    directory (verified; no fallback).
    ``on_newer_checkpoints``: what a resume from a checkpoint older than others in ``checkpoint_dir`` does: ``refuse``
    (stop with one line) or ``archive`` (move the newer ones into ``checkpoint_dir/archive/attempt-<N>/``, untouched).
    """

    enabled: bool = True
    checkpoint_dir: str | None = None
    resume: str = "auto"
    keep_last: PositiveInt | None = 2
    save_final: bool = True
    on_newer_checkpoints: Literal["refuse", "archive"] = "refuse"


class WandbConfig(StrictModel):
    """``logging.wandb``: also log to Weights & Biases (needs ``pip install 'remat[wandb]'``; never required)."""

    project: str = "remat"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = Field(default_factory=list)
    mode: Literal["online", "offline", "disabled"] = "online"


class LoggingConfig(StrictModel):
    """``logging``: the per-step log line, the metrics file and how memory is measured."""

    log_every_steps: PositiveInt = 1
    progress: Literal["auto", "rich", "plain"] = "auto"
    memory: Literal["auto", "cuda", "tracked", "rss"] = "auto"
    metrics_file: str | None = "metrics.jsonl"
    """A file inside ``output_dir`` (a relative path without ``..``): a recipe writes only in its run's directory."""
    tensorboard: bool = False
    wandb: WandbConfig | None = None

    @field_validator("metrics_file")
    @classmethod
    def _inside_the_run(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = PurePath(value).parts
        if not value or PurePath(value).is_absolute() or ".." in parts or value.startswith("~"):
            raise ValueError("a recipe writes only in its run's directory; allowed: a file name inside output_dir (a "
                             "relative path without '..', e.g. metrics.jsonl), or null for none")
        return value


class PeftConfig(StrictModel):
    """``peft``: LoRA adapters through the ``peft`` library; only the adapters are trained."""

    method: Literal["lora"] = "lora"
    r: PositiveInt = 8
    lora_alpha: PositiveFloat = 16.0
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | str = "all-linear"
    """Module names (a list: a module whose name ends with one is adapted), ``all-linear``, or one regular expression
    that the whole module name must match (PEFT's meaning of a string)."""
    exclude_modules: list[str] | str | None = None
    """Modules never adapted, spelt like ``target_modules`` (PEFT's ``exclude_modules``)."""

    @field_validator("target_modules", "exclude_modules")
    @classmethod
    def _names_or_pattern(cls, value: list[str] | str | None) -> list[str] | str | None:
        if isinstance(value, str) and value != "all-linear":
            try:
                re.compile(value)
            except re.error as err:
                raise ValueError(f"{value!r} is not a regular expression ({err}); allowed: module names (a list), "
                                 "all-linear, or a regular expression matching whole module names") from None
        if isinstance(value, list) and not all(value):
            raise ValueError("an empty module name; allowed: module names such as q_proj")
        return value


class RecipeConfig(StrictModel):
    """A whole fine-tuning recipe. Every section but ``model`` has defaults."""

    seed: int = Field(default=1234, ge=0, lt=2**63)  # what torch.manual_seed, random and numpy all accept
    output_dir: str = ""
    """Where metrics and checkpoints go. Left empty: ``outputs/<recipe file stem>`` for a recipe file
    (`remat.recipes.loader.load_recipe`), ``outputs/run-<8 hex digits of the run's identity>`` otherwise
    (`remat.recipes.run_safety.resume_rules.default_output_dir`), so two recipes never share one by accident."""
    custom_target_packages: list[str] = Field(default_factory=list)
    model: ModelConfig
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    validation_dataset: DatasetConfig | None = None
    step_scheduler: StepSchedulerConfig = Field(default_factory=StepSchedulerConfig)
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig.model_validate({"lr": 3e-4}))
    lr_scheduler: LRSchedulerConfig = Field(default_factory=LRSchedulerConfig)
    loss_fn: LossConfig = Field(default_factory=LossConfig)
    clip_grad_norm: ClipGradNormConfig = Field(default_factory=ClipGradNormConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    compile: CompileConfig = Field(default_factory=CompileConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    peft: PeftConfig | None = None

    def with_checkpointing(self, setting: CheckpointPolicy | AutoCheckpointing) -> RecipeConfig:
        """A copy with ``distributed.activation_checkpointing`` set to ``setting`` (a candidate the planner prices,
        a plan filled in): nothing else is validated again."""
        return self.model_copy(update={"distributed": self.distributed.model_copy(
            update={"activation_checkpointing": setting})})

    @field_validator("custom_target_packages")
    @classmethod
    def _packages_allowed(cls, value: list[str]) -> list[str]:
        from remat.recipes.targets import check_custom_packages

        return list(check_custom_packages(value))

    @model_validator(mode="after")
    def _derived_output_dir(self) -> RecipeConfig:
        if not self.output_dir:
            from remat.recipes.run_safety.resume_rules import default_output_dir

            # Not an assignment: validate_assignment would run this validator again.
            self.__dict__["output_dir"] = default_output_dir(self.model_dump(mode="json", by_alias=True))
        return self
