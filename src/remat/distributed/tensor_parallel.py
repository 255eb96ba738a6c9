"""Tensor parallelism for the model families whose layout is known, with torch's DTensor parallel styles.

Inside each transformer block the attention projections q/k/v and the MLP's gate/up projections are split by output
features (``ColwiseParallel``: each rank computes its own heads / its slice of the intermediate features), and the
output projections o/down by input features (``RowwiseParallel``: partial results summed across the tensor-parallel
ranks). Activations between blocks stay whole (replicated); embeddings, norms and the output head are not split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from remat.errors import ConfigError

Style = Literal["colwise", "rowwise"]

_DECODER_PLAN: Final[dict[str, Style]] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}

#: model_type -> {module path inside a block: style}. Families whose attention splits cleanly by heads and whose MLP
#: is a gated up/down pair, checked against one process (gradients within 2e-7). Not listed: models with per-head
#: q/k norms (qwen3, gemma3, olmo2): one norm weight serves every head, so its gradient would need a sum over the
#: tensor-parallel ranks that this plan does not add.
TP_PLANS: Final[dict[str, Mapping[str, Style]]] = {
    name: _DECODER_PLAN for name in ("llama", "mistral", "qwen2", "gemma", "gemma2")
}


def tp_plan_for(config: Any) -> Mapping[str, Style]:
    """The block plan of a transformers config's ``model_type``; ConfigError naming the supported types otherwise."""
    model_type = getattr(config, "model_type", None)
    plan = TP_PLANS.get(model_type)  # type: ignore[arg-type]
    if plan is None:
        raise ConfigError(
            f"distributed.tp_size: tensor parallelism has no known plan for model_type {model_type!r}; allowed: "
            f"model types {', '.join(sorted(TP_PLANS))} (or tp_size: 1)"
        )
    return plan


def check_divisible(config: Any, tp_size: int) -> None:
    """Attention heads, key/value heads and MLP width must split evenly over ``tp_size`` ranks."""
    heads = getattr(config, "num_attention_heads", None)
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": getattr(config, "intermediate_size", None),
    }
    bad = {name: value for name, value in sizes.items() if not isinstance(value, int) or value % tp_size}
    if bad:
        found = ", ".join(f"{name}={value}" for name, value in bad.items())
        raise ConfigError(f"distributed.tp_size: {tp_size} does not divide the model's {found}; allowed: a tp_size "
                          "that divides the attention heads, key/value heads and intermediate size")


def apply_tensor_parallel(config: Any, blocks: Sequence[nn.Module], tp_mesh: DeviceMesh) -> int:
    """Split the linear layers of every block over ``tp_mesh`` in place; returns how many layers were split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = tp_plan_for(config)
    check_divisible(config, tp_mesh.size())
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    count = 0
    for block in blocks:
        present = {path: styles[style]() for path, style in plan.items() if _has_submodule(block, path)}
        if not present:
            raise ConfigError(f"distributed.tp_size: block {type(block).__name__} has none of the layers of the "
                              f"{getattr(config, 'model_type', None)!r} plan ({', '.join(plan)})")
        parallelize_module(block, tp_mesh, present)
        count += len(present)
    return count


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True
