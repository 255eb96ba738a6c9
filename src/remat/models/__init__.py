"""Models: build a causal LM from pretrained weights (a local directory or a Hub id), a named shape preset or a
transformers config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "resolve_model_config": "remat.models.build",
    "ModelConfig": "remat.models.config",
    "QuantizationConfig": "remat.models.quantization",
    "build_model": "remat.models.build",
    "get_preset": "remat.models.presets",
    "preset_names": "remat.models.presets",
    "count_parameters": "remat.models.build",
}

__all__ = [
    "resolve_model_config",
    "ModelConfig",
    "QuantizationConfig",
    "build_model",
    "count_parameters",
    "get_preset",
    "preset_names",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.models.build import build_model, count_parameters, resolve_model_config
    from remat.models.config import ModelConfig
    from remat.models.presets import get_preset, preset_names
    from remat.models.quantization import QuantizationConfig
