"""transformers' own activation checkpointing, under the method names the installed transformers has:
``activation_checkpointing_enable`` / ``_disable`` / ``is_activation_checkpointing`` where they exist (newer
releases), else the older ``gradient_checkpointing_*`` names (transformers 5.17 has only those)."""

from __future__ import annotations

import warnings

from torch import nn

_NEW, _OLD = "activation_checkpointing", "gradient_checkpointing"


def hf_method(model: nn.Module, action: str) -> str:
    """Name of transformers' ``<prefix>_<action>`` method on ``model`` (``action``: ``"enable"`` or ``"disable"``),
    preferring ``activation_checkpointing_*`` when this transformers has it."""
    new = f"{_NEW}_{action}"
    return new if hasattr(model, new) else f"{_OLD}_{action}"


def enable_hf_checkpointing(model: nn.Module) -> str:
    """Turn on transformers' own non-reentrant checkpointing of every decoder layer; returns the method called."""
    name = hf_method(model, "enable")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable is deprecated where both exist
        getattr(model, name)(**{f"{name.rsplit('_', 1)[0]}_kwargs": {"use_reentrant": False}})
    return name


def disable_hf_checkpointing(model: nn.Module) -> str:
    """Turn transformers' own checkpointing off again; returns the method called."""
    name = hf_method(model, "disable")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        getattr(model, name)()
    return name


def is_hf_checkpointing(model: nn.Module) -> bool:
    """Whether transformers reports its own checkpointing as on for ``model``."""
    flag = f"is_{_NEW}" if hasattr(model, f"is_{_NEW}") else f"is_{_OLD}"
    return bool(getattr(model, flag, False))  # a model that is not transformers' has none of its own
