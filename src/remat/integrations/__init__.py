"""Where people already train: the Hugging Face Trainer and its subclasses (TRL's SFTTrainer, DPOTrainer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "prepare_trainer": "remat.integrations.hf_trainer",
}

__all__ = [
    "prepare_trainer",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.integrations.hf_trainer import prepare_trainer
