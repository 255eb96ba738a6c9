"""Checks of the shape numbers of a transformers config before anything is built from it.

transformers validates some of them (and not the same ones for every architecture): `hidden_size: 0` fails deep in
the rotary embedding with a ZeroDivisionError, `-64` when a weight of negative size is created,
`num_key_value_heads: 0` in an integer division. These checks run on the mapping a recipe gives, so every such
mistake is one `ConfigError` naming the key (with the spelling the architecture uses, e.g. `n_embd` for GPT-2).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Final

from transformers import PretrainedConfig

from remat.errors import ConfigError

POSITIVE_KEYS: Final[tuple[str, ...]] = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "head_dim",
)
"""Standard config names whose value, when given (not null), must be an integer >= 1."""


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
