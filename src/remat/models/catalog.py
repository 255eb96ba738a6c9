"""A readable summary of the presets (shape and parameter count measured on the meta device), for docs and CLIs."""

from __future__ import annotations

from dataclasses import dataclass

from remat.models.build import build_model, count_parameters
from remat.models.config import ModelConfig
from remat.models.presets import PRESETS


@dataclass(frozen=True)
class PresetSummary:
    """One preset's shape as transformers builds it (vocabulary: the preset's default)."""

    name: str
    model_type: str
    layers: int
    hidden_size: int
    attention_heads: int
    kv_heads: int
    mlp: str
    vocab_size: int
    vocab_from_tokenizer: bool
    parameters: int
    source: str


def summarize_presets() -> list[PresetSummary]:
    """Build every preset on the meta device (no memory, about a second in all) and describe it."""
    rows = []
    for name, preset in PRESETS.items():
        model = build_model(ModelConfig(preset=name), meta=True)
        config = model.config
        rows.append(PresetSummary(
            name=name,
            model_type=config.model_type,
            layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            attention_heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            mlp=_describe_mlp(config),
            vocab_size=config.vocab_size,
            vocab_from_tokenizer=bool(preset.tokenizer_vocab_keys),
            parameters=count_parameters(model),
            source=preset.source,
        ))
    return rows


def presets_markdown_table() -> str:
    """The presets as a Markdown table (the one in docs/models.md)."""
    lines = [
        "| preset | model_type | layers | hidden | heads (kv) | MLP | vocab | parameters | source |",
        "|---|---|---:|---:|---|---|---:|---:|---|",
    ]
    for row in summarize_presets():
        vocab = f"{row.vocab_size:,}" + (" (tokenizer)" if row.vocab_from_tokenizer else "")
        lines.append(
            f"| `{row.name}` | {row.model_type} | {row.layers} | {row.hidden_size} | "
            f"{row.attention_heads} ({row.kv_heads}) | {row.mlp} | {vocab} | {row.parameters:,} | {row.source} |"
        )
    return "\n".join(lines) + "\n"


def _describe_mlp(config: object) -> str:
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size  # type: ignore[attr-defined]
    if isinstance(width, list):
        width = width[0] if len(set(width)) == 1 else "/".join(map(str, width))
    if experts:
        return f"{experts} experts x {width}, top-{config.num_experts_per_tok}"  # type: ignore[attr-defined]
    return str(width)
