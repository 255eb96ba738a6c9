"""Checks of the shape numbers of a transformers config before anything is built from it.

transformers validates some of them (and not the same ones for every architecture): `hidden_size: 0` fails deep in
the rotary embedding with a ZeroDivisionError, `-64` when a weight of negative size is created,
`num_key_value_heads: 0` in an integer division. These checks run on the mapping a recipe gives, so every such
mistake is one `ConfigError` naming the key (with the spelling the architecture uses, e.g. `n_embd` for GPT-2).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any, Final

import torch
from torch._subclasses.fake_tensor import FakeTensor  # what tensors are under the estimate's FakeTensorMode
from transformers import PretrainedConfig

from remat.errors import ConfigError
from remat.units import format_bytes

POSITIVE_KEYS: Final[tuple[str, ...]] = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "head_dim", "max_position_embeddings",
)
"""Standard config names whose value, when given (not null), must be an integer >= 1."""
MAX_LAYERS: Final[int] = 4096
"""The most blocks a config may have: the deepest published causal LMs have about 200; building a million takes
minutes before anything could fail."""


def check_config_shape(config_class: type[PretrainedConfig], fields: Mapping[str, Any],
                       *, prefix: str = "model.config") -> None:
    """Raise `ConfigError` naming the key when a shape number in ``fields`` (the keyword arguments a config of
    ``config_class`` is about to be built from) is not a positive integer, when ``num_key_value_heads`` does not
    divide ``num_attention_heads``, or when ``num_attention_heads`` does not divide ``hidden_size`` and no
    ``head_dim`` is given (the head size is then their quotient)."""
    aliases = dict(getattr(config_class, "attribute_map", {}) or {})
    spelled = {name: aliases.get(name, name) for name in POSITIVE_KEYS}
    given = {name: fields[key] for name, key in spelled.items() if fields.get(key) is not None}
    for name, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{prefix}.{spelled[name]}: got {value!r}; allowed: an integer >= 1")
    if not given.keys() & {"hidden_size", "num_attention_heads", "num_key_value_heads"}:
        return

    def value_of(name: str) -> Any:
        if spelled[name] in fields:  # given (null: transformers derives it, e.g. KV heads = attention heads)
            return fields[spelled[name]]
        return getattr(_defaults(config_class), spelled[name], None)

    heads, kv_heads, hidden = value_of("num_attention_heads"), value_of("num_key_value_heads"), value_of("hidden_size")
    if "head_dim" not in given and isinstance(heads, int) and isinstance(hidden, int) and hidden % heads:
        raise ConfigError(f"{prefix}.{spelled['num_attention_heads']}: {heads} does not divide "
                          f"{spelled['hidden_size']}={hidden}; allowed: a divisor of it, or set head_dim")
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise ConfigError(f"{prefix}.{spelled['num_key_value_heads']}: {kv_heads} does not divide "
                          f"{spelled['num_attention_heads']}={heads}; allowed: a divisor of it (1 to {heads})")


@functools.lru_cache(maxsize=None)
def _defaults(config_class: type[PretrainedConfig]) -> PretrainedConfig | None:
    """The config class's default instance (its default shape numbers); None when it cannot be built bare."""
    try:
        return config_class()
    except Exception:  # some configs need arguments; their defaults are then unknown and not checked
        return None


def parameter_bytes_at_least(config: PretrainedConfig, element_bytes: int) -> int:
    """A lower bound on the bytes of the parameters of a model of `config`: its input embeddings (and an untied
    output head) and two ``hidden x intermediate`` matrices per block. Every decoder has at least these, so a
    bound over the device's memory means the model cannot be built there (the estimate counts the rest)."""
    hidden = _int(getattr(config, "hidden_size", None))
    vocab = _int(getattr(config, "vocab_size", None))
    layers = _int(getattr(config, "num_hidden_layers", None))
    inner = _int(getattr(config, "intermediate_size", None))
    heads = 1 if getattr(config, "tie_word_embeddings", True) else 2
    return element_bytes * (heads * vocab * hidden + layers * 2 * hidden * inner)


def check_buildable(config: PretrainedConfig, element_bytes: int, device: Any, key: str) -> None:
    """ConfigError naming `key` when a real model of `config` cannot be built: more than `MAX_LAYERS` blocks, or
    parameters beyond `device`'s memory (the machine's physical memory for the CPU, the GPU's for CUDA), said
    before anything is allocated. Under fake tensors (the estimate) nothing is allocated, and nothing is checked."""
    if isinstance(torch.empty(0), FakeTensor):
        return
    layers = _int(getattr(config, "num_hidden_layers", None))
    if layers > MAX_LAYERS:
        raise ConfigError(f"{key}: num_hidden_layers {layers}; allowed: at most {MAX_LAYERS} (the deepest published "
                          "causal LMs have about 200)")
    need = parameter_bytes_at_least(config, element_bytes)
    have, where = _device_bytes(device)
    if have is None or need <= have:
        return
    shape = ", ".join(f"{name} {getattr(config, name)}" for name in ("num_hidden_layers", "hidden_size",
                                                                     "intermediate_size", "vocab_size")
                      if _int(getattr(config, name, None)))
    raise ConfigError(f"{key}: the parameters alone need at least {format_bytes(need)} ({shape}), more than the {format_bytes(have)} "
                      f"of {where}; allowed: a smaller shape, or a device with more memory (FSDP2 over several)")


def _device_bytes(device: Any) -> tuple[int | None, str]:
    target = torch.device(device)
    if target.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(target.index or 0).total_memory, f"the GPU ({target})"
    if target.type == "cpu":
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "this machine's memory"
        except (ValueError, OSError, AttributeError):
            return None, ""
    return None, ""


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


