"""A recipe against the number of processes it runs on (strategy, parallel sizes, batch sizes), without torch
(but for ``cp_size`` > 1, whose heads are read from the model's config): the launcher checks it before any worker
starts, each worker again before it builds anything."""

from __future__ import annotations

from remat.distributed.layout import check_heads, world_layout
from remat.recipes.config import RecipeConfig


def check_parallel_layout(cfg: RecipeConfig, world_size: int) -> tuple[int, int]:
    """(data-parallel size, gradient-accumulation steps) of the recipe on ``world_size`` processes; ConfigError naming
    the key when the ``distributed`` section or the batch sizes do not fit them."""
    d = cfg.distributed
    dp_size = world_layout(d.strategy, d.dp_size, d.tp_size, d.cp_size, world_size=world_size)
    accumulation = cfg.step_scheduler.accumulation_steps(dp_size, world_size)
    if d.cp_size > 1:
        _check_context_heads(cfg)
    return dp_size, accumulation


def _check_context_heads(cfg: RecipeConfig) -> None:
    """``cp_size`` (x ``tp_size``) must divide the attention heads (read from the model's config: no weights)."""
    from remat.models.build import resolve_model_config

    config = resolve_model_config(cfg.model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    check_heads(getattr(text, "num_attention_heads", None), cfg.distributed.cp_size, cfg.distributed.tp_size)
