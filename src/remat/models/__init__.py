"""Models: build a causal LM from pretrained weights (a local directory or a Hub id), a named shape preset or a
transformers config."""

from __future__ import annotations

from remat.models.build import build_model, count_parameters, model_from_config, resolve_model_config
from remat.models.catalog import PresetSummary, presets_markdown_table, summarize_presets
from remat.models.config import ModelConfig
from remat.models.presets import PRESETS, ModelPreset, get_preset, preset_names

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
