"""remat: memory-efficient training of causal language models in PyTorch.

The public API, re-exported here (nothing inside the package imports from this module):

- ``apply_activation_checkpointing(model, policy="full", **options) -> CheckpointPlan`` and ``CheckpointPolicy``:
  recompute instead of store, per block, with full / selective / attention / mlp / every-n / sqrt / offload policies.
- ``remat.loss.FusedLinearCrossEntropy`` and ``remat.loss.MaskedCrossEntropy``.
- ``LiveTensorTracker`` and ``StepMemoryMeter`` (``remat.memory``): exact memory accounting;
  ``estimate_memory(...) -> MemoryEstimate`` (``remat.estimate``): a training step's peak predicted on fake tensors.
- ``DistributedSetup``: how the model is spread over processes, and the order savers are applied in.
- ``build_model`` / ``ModelConfig`` (``remat.models``), ``FinetuneRecipe`` / ``load_recipe`` (``remat.recipes``).
"""

from __future__ import annotations

import os

# OpenMP's default active spin-wait collapses torch's CPU threads when another process holds a core: measured on a
# 2-core machine, a tiny Llama forward+backward went from 0.42 s to 4.4 s with 2 threads. A passive wait costs little
# when the cores are free. It must be set before torch loads OpenMP; a value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from remat import loss  # noqa: E402
from remat.checkpointing import CheckpointPlan, CheckpointPolicy, apply_activation_checkpointing, parse_policy  # noqa: E402
from remat.distributed import DistributedSetup  # noqa: E402
from remat.errors import CheckpointingError, ConfigError, RematError  # noqa: E402
from remat.estimate import MemoryEstimate, estimate_memory  # noqa: E402
from remat.memory import LiveTensorTracker, MemoryReading, StepMemoryMeter  # noqa: E402
from remat.models import ModelConfig, build_model  # noqa: E402
from remat.recipes.finetune import FinetuneRecipe  # noqa: E402
from remat.recipes.loader import load_recipe  # noqa: E402

__version__ = "0.1.0"

__all__ = [
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
]
