"""Models: build a causal LM from pretrained weights (a local directory or a Hub id), a named shape preset or a
transformers config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "build_model": "remat.models.build",
    "count_parameters": "remat.models.build",
    "model_from_config": "remat.models.build",
    "resolve_model_config": "remat.models.build",
    "PresetSummary": "remat.models.catalog",
    "presets_markdown_table": "remat.models.catalog",
    "summarize_presets": "remat.models.catalog",
    "ModelConfig": "remat.models.config",
    "PRESETS": "remat.models.presets",
    "ModelPreset": "remat.models.presets",
    "get_preset": "remat.models.presets",
    "preset_names": "remat.models.presets",
}

__all__ = [
    "PRESETS",
    "ModelConfig",
    "ModelPreset",
    "PresetSummary",
    "build_model",
    "count_parameters",
    "get_preset",
    "model_from_config",
    "preset_names",
    "presets_markdown_table",
    "resolve_model_config",
    "summarize_presets",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.models.build import build_model, count_parameters, model_from_config, resolve_model_config
    from remat.models.catalog import PresetSummary, presets_markdown_table, summarize_presets
    from remat.models.config import ModelConfig
    from remat.models.presets import PRESETS, ModelPreset, get_preset, preset_names
