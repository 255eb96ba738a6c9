"""The fine-tuning recipe schema: one strict pydantic model per YAML section.

Component sections (``model``, ``tokenizer``, ``dataset``) are owned by their packages; this module composes them and
adds the sections that only the recipe uses. Every section rejects unknown keys; ``remat.recipes.loader`` turns
validation errors into messages that name the dotted key, the given value and what is allowed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import PurePath
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    field_validator,
    model_validator,
)

from remat.checkpointing.policy import CheckpointPolicy
from remat.config_base import StrictModel
from remat.data.config import DatasetConfig, TokenizerConfig
from remat.distributed.config import AutoCheckpointing, DistributedConfig
from remat.errors import ConfigError
from remat.models.config import ModelConfig
from remat.models.fp8 import FP8Config
from remat.models.qat import QATConfig

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
    neftune_noise_alpha: PositiveFloat | None = None
    """NEFTune: uniform noise of magnitude ``alpha / sqrt(seq_length x hidden_size)`` added to the input embeddings
    in training steps (not in validation), through transformers' own hook (``TrainingArguments.neftune_noise_alpha``'s
    meaning); null: none."""


COMPILE_BACKENDS: tuple[str, ...] = ("inductor", "aot_eager", "eager", "cudagraphs")
COMPILE_MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class CompileConfig(StrictModel):
    """``compile``: ``torch.compile`` of each decoder block after activation checkpointing wraps it (and before
    FSDP2 / DDP wrap the model), as TorchTitan compiles per block: ``backend``, ``mode``, ``fullgraph`` and
    ``dynamic`` are ``torch.compile``'s. Off by default. The estimate and the planner simulate the compiled blocks
    (`remat.estimate.compiled`)."""

    enabled: bool = False
    backend: Literal["inductor", "aot_eager", "eager", "cudagraphs"] = "inductor"
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = None
    fullgraph: bool = False
    dynamic: bool | None = None


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
    group: str | None = None
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
    lora_a_init: Literal["kaiming_uniform", "xavier_normal"] = "kaiming_uniform"
    """How each adapter's A starts (B starts at zero either way): PEFT's Kaiming-uniform, or NeMo AutoModel's
    Xavier-normal."""
    dropout_position: Literal["pre", "post"] = "pre"
    """Where ``lora_dropout`` acts: on the adapter's input (``pre``, PEFT's) or on its output (``post``, NeMo
    AutoModel's)."""

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
    fp8: FP8Config = Field(default_factory=FP8Config)
    qat: QATConfig = Field(default_factory=QATConfig)
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
