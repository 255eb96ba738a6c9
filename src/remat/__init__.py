"""remat: memory-efficient training of causal language models in PyTorch.

The public API, re-exported here (nothing inside the package imports from this module):

- ``apply_activation_checkpointing(model, policy="full", **options) -> CheckpointPlan`` and ``CheckpointPolicy``:
  recompute instead of store, per block, with full / selective / attention / mlp / every-n / sqrt / offload policies.
- ``remat.loss.FusedLinearCrossEntropy`` and ``remat.loss.MaskedCrossEntropy``.
- ``LiveTensorTracker`` and ``StepMemoryMeter`` (``remat.memory``): exact memory accounting;
  ``estimate_memory(...) -> MemoryEstimate`` (``remat.estimate``): a training step's peak predicted on fake tensors.
- ``plan_activation_checkpointing(model_or_recipe, memory_budget=...) -> ActivationPlan`` (``remat.planner``): the
  per-layer policy with the least predicted recompute that fits a budget; ``apply_activation_checkpointing`` takes it.
- ``DistributedSetup``: how the model is spread over processes, and the order savers are applied in.
- ``AutoModelForCausalLM.from_pretrained(path_or_hub_id_or_preset, distributed_setup=...)`` / ``.from_config``:
  build a model and apply the setup's checkpointing and parallelism in one call (the plan in ``model.remat_plan``).
- ``prepare_trainer(trainer, policy=..., loss="fused")`` (``remat.integrations``): the same in a Hugging Face
  ``Trainer`` or TRL trainer, in one call before ``trainer.train()``.
- ``build_model`` / ``ModelConfig`` (``remat.models``), ``FinetuneRecipe`` / ``load_recipe`` (``remat.recipes``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Names are imported on first use (PEP 562, remat._lazy), so that `import remat` (and `remat.cli`, which sets
# OMP_WAIT_POLICY before torch loads) neither loads torch nor changes the process's environment.
_EXPORTS: dict[str, str] = {
    "AutoModelForCausalLM": "remat.auto",
    "CheckpointPlan": "remat.checkpointing",
    "CheckpointPolicy": "remat.checkpointing",
    "apply_activation_checkpointing": "remat.checkpointing",
    "parse_policy": "remat.checkpointing",
    "DistributedSetup": "remat.distributed",
    "CheckpointingError": "remat.errors",
    "ConfigError": "remat.errors",
    "RematError": "remat.errors",
    "MemoryEstimate": "remat.estimate",
    "estimate_memory": "remat.estimate",
    "ActivationPlan": "remat.planner",
    "plan_activation_checkpointing": "remat.planner",
    "LiveTensorTracker": "remat.memory",
    "MemoryReading": "remat.memory",
    "StepMemoryMeter": "remat.memory",
    "ModelConfig": "remat.models",
    "build_model": "remat.models",
    "FinetuneRecipe": "remat.recipes.finetune",
    "load_recipe": "remat.recipes.loader",
    "prepare_trainer": "remat.integrations",
    "loss": "remat.loss",
}

try:
    __version__ = version("remat")
except PackageNotFoundError:  # a source tree on the import path, not installed
    __version__ = "0+unknown"

__all__ = [
    "ActivationPlan",
    "AutoModelForCausalLM",
    "CheckpointPlan",
    "CheckpointPolicy",
    "CheckpointingError",
    "ConfigError",
    "DistributedSetup",
    "FinetuneRecipe",
    "LiveTensorTracker",
    "MemoryEstimate",
    "MemoryReading",
    "ModelConfig",
    "RematError",
    "StepMemoryMeter",
    "__version__",
    "apply_activation_checkpointing",
    "build_model",
    "estimate_memory",
    "load_recipe",
    "loss",
    "parse_policy",
    "plan_activation_checkpointing",
    "prepare_trainer",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


if TYPE_CHECKING:
    from remat import loss
    from remat.auto import AutoModelForCausalLM
    from remat.checkpointing import CheckpointPlan, CheckpointPolicy, apply_activation_checkpointing, parse_policy
    from remat.distributed import DistributedSetup
    from remat.errors import CheckpointingError, ConfigError, RematError
    from remat.estimate import MemoryEstimate, estimate_memory
    from remat.integrations import prepare_trainer
    from remat.memory import LiveTensorTracker, MemoryReading, StepMemoryMeter
    from remat.models import ModelConfig, build_model
    from remat.planner import ActivationPlan, plan_activation_checkpointing
    from remat.recipes.finetune import FinetuneRecipe
    from remat.recipes.loader import load_recipe
