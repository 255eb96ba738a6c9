"""Named model shapes: the public config numbers of well-known causal LMs, built with random weights.

A preset is only a transformers config as a mapping; nothing is downloaded. Large presets reproduce the published
`config.json` of the model named in `source` (architecture fields only: token ids and shapes, not weights), so memory
estimates and throughput measurements on them match the real model. Small presets exist for the CPU.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from remat.errors import ConfigError

DEFAULT_SMALL_VOCAB_SIZE = 8192
"""Vocabulary of the small presets when no tokenizer tells its size."""


@dataclass(frozen=True)
class ModelPreset:
    """A named transformers config (``config["model_type"]`` included) and where its numbers come from.

    `tokenizer_vocab_keys` lists the config keys set to the tokenizer's vocabulary size when the caller knows it
    (the small presets take their vocabulary from the tokenizer; the published shapes keep their own).
    """

    name: str
    source: str
    description: str
    config: Mapping[str, Any]
    hub_id: str | None = None
    tokenizer_vocab_keys: tuple[str, ...] = field(default=())

    @property
    def model_type(self) -> str:
        """The transformers `model_type` of this preset."""
        return str(self.config["model_type"])


def _public(
    name: str, hub_id: str, description: str, config: dict[str, Any], *, part: str = "config"
) -> ModelPreset:
    return ModelPreset(
        name=name,
        source=f"public {part} of {hub_id}",
        description=description,
        config=MappingProxyType(config),
        hub_id=hub_id,
    )


def _small(name: str, description: str, config: dict[str, Any], vocab_keys: tuple[str, ...]) -> ModelPreset:
    return ModelPreset(
        name=name,
        source="remat (a small shape for the CPU)",
        description=description,
        config=MappingProxyType(config),
        tokenizer_vocab_keys=vocab_keys,
    )


_LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                        "original_max_position_embeddings": 8192}

_PRESET_LIST: tuple[ModelPreset, ...] = (
    _public("llama-3.2-1b", "meta-llama/Llama-3.2-1B", "Llama 3.2 1B, dense, GQA, tied embeddings", {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE_SCALING, "factor": 32.0},
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001,
    }),
    _public("llama-3.1-8b", "meta-llama/Llama-3.1-8B", "Llama 3.1 8B, dense, GQA", {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "rope_theta": 500000.0, "rope_scaling": {**_LLAMA3_ROPE_SCALING, "factor": 8.0},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 128000, "eos_token_id": 128001,
    }),
    _public("qwen3-0.6b", "Qwen/Qwen3-0.6B", "Qwen3 0.6B, dense, QK-norm, tied embeddings", {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
    }),
    _public("qwen3-8b", "Qwen/Qwen3-8B", "Qwen3 8B, dense, QK-norm", {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645,
    }),
    _public("gemma-3-1b", "google/gemma-3-1b-pt",
            "Gemma 3 1B text model: 5 sliding-window (512) layers per global layer, MQA", {
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152, "intermediate_size": 6912,
        "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "query_pre_attn_scalar": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "sliding_window": 512, "sliding_window_pattern": 6, "tie_word_embeddings": True,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    }),
    _public("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", "Mixtral 8x7B: sparse MoE, 8 experts, top-2", {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_theta": 1000000.0,
        "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    }),
    _public("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", "Qwen3 30B-A3B: sparse MoE, 128 experts, top-8", {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151645,
    }),
    _public("gemma-3n-e2b", "google/gemma-3n-E2B",
            "Gemma 3n E2B text tower: per-layer embeddings, AltUp, LAuReL, last 10 layers share KV", {
        "model_type": "gemma3n_text", "vocab_size": 262400, "vocab_size_per_layer_input": 262144,
        "hidden_size": 2048, "hidden_size_per_layer_input": 256, "intermediate_size": 8192,
        "num_hidden_layers": 30, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "num_kv_shared_layers": 10, "laurel_rank": 64, "altup_num_inputs": 4, "altup_active_idx": 0,
        "altup_coef_clip": 120.0, "altup_correct_scale": True, "sliding_window": 512,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
    }, part="text_config"),
    _small("tiny-llama", "the quickstart default: a ~5M-parameter Llama (hidden 256, 4 layers, GQA 4/2)", {
        "model_type": "llama", "vocab_size": DEFAULT_SMALL_VOCAB_SIZE, "hidden_size": 256,
        "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None,
    }, ("vocab_size",)),
    _small("llama-20m", "a ~20M-parameter Llama for CPU benchmarks (hidden 512, 6 layers, GQA 8/4)", {
        "model_type": "llama", "vocab_size": DEFAULT_SMALL_VOCAB_SIZE, "hidden_size": 512,
        "intermediate_size": 1376, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None,
    }, ("vocab_size",)),
    _small("tiny-moe", "a tiny Qwen3-MoE (4 layers, 8 experts, top-2) for the CPU", {
        "model_type": "qwen3_moe", "vocab_size": DEFAULT_SMALL_VOCAB_SIZE, "hidden_size": 128,
        "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None,
    }, ("vocab_size",)),
    _small("tiny-gemma3n", "a tiny Gemma 3n text model whose last 2 of 4 layers share KV (sliding/full pairs)", {
        "model_type": "gemma3n_text", "vocab_size": DEFAULT_SMALL_VOCAB_SIZE,
        "vocab_size_per_layer_input": DEFAULT_SMALL_VOCAB_SIZE, "hidden_size": 128,
        "hidden_size_per_layer_input": 16, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0], "laurel_rank": 8, "altup_num_inputs": 2,
        "sliding_window": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "final_logit_softcapping": 30.0, "tie_word_embeddings": True,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
    }, ("vocab_size", "vocab_size_per_layer_input")),
)

PRESETS: Mapping[str, ModelPreset] = MappingProxyType({p.name: p for p in _PRESET_LIST})
"""Every preset by its canonical (lower-case) name."""


def preset_names() -> list[str]:
    """The canonical preset names, in table order."""
    return [p.name for p in _PRESET_LIST]


def get_preset(name: str, *, key: str = "model.preset") -> ModelPreset:
    """The preset called `name` (case-insensitive); a ConfigError naming `key` lists the choices otherwise."""
    preset = PRESETS.get(name.strip().lower())
    if preset is not None:
        return preset
    close = difflib.get_close_matches(name.strip().lower(), preset_names(), n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"{key}: unknown preset {name!r}.{hint} Available presets: {', '.join(preset_names())}.")


def preset_for_hub_id(hub_id: str) -> ModelPreset | None:
    """The preset that reproduces the shape of the Hub model `hub_id` (case-insensitive), if there is one."""
    wanted = hub_id.strip().lower()
    for preset in _PRESET_LIST:
        if preset.hub_id is not None and preset.hub_id.lower() == wanted:
            return preset
    return None
