"""FP8 training of a model's linear layers through torchao (`torchao.float8`): the recipe's ``fp8`` section.

Each ``nn.Linear`` whose dimensions are both multiples of 16 (what FP8 matrix multiplies take) and whose name holds
none of ``filter_fqns`` becomes torchao's ``Float8Linear``: its inputs, weight and output gradient are cast to FP8
(dynamic scales) for the three matrix multiplies of forward and backward; parameters, gradients and optimizer state
keep the model's dtype. FP8 matrix multiplies need a CUDA GPU of compute capability 8.9 or later (Ada, Hopper,
Blackwell); ``emulate: true`` computes the same casts with ordinary matrix multiplies (any device, the CPU included:
for testing). torchao is an optional dependency (``pip install 'remat[fp8]'``), imported only when ``fp8.enabled``.

The keys are NeMo AutoModel's (and TorchTitan's ``float8``): ``recipe_name`` is torchao's scaling recipe
(``tensorwise``: one scale per tensor; ``rowwise``; ``rowwise_with_gw_hp``: rowwise with the weight gradient in high
precision); ``enable_fsdp_float8_all_gather`` makes FSDP2 gather the sharded weights in FP8 (half the traffic of
bfloat16), and ``precompute_float8_dynamic_scale_for_fsdp`` computes their scales for all layers at once after each
optimizer step (both tensorwise only); ``force_recompute_fp8_weight_in_bwd`` casts the weight again in backward
instead of keeping its FP8 copy (tensorwise only).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from remat.config_base import StrictModel
from remat.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)

FP8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: FP8 matrix multiplies (torch._scaled_mm) need this CUDA compute capability or later.
FP8_CAPABILITY: tuple[int, int] = (8, 9)


class FP8Config(StrictModel):
    """``fp8``: FP8 training of the linear layers (`remat.models.fp8`); off unless ``enabled``."""

    enabled: bool = False
    recipe_name: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    enable_fsdp_float8_all_gather: bool = False
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    force_recompute_fp8_weight_in_bwd: bool = False
    filter_fqns: list[str] = Field(default_factory=list)
    """Linear layers whose name contains one of these stay in the model's dtype (e.g. ``lm_head``)."""
    emulate: bool = False
    """FP8 casts with ordinary matrix multiplies: any device (the CPU included); for testing, not for speed."""

    @model_validator(mode="after")
    def _tensorwise_only(self) -> FP8Config:
        if self.recipe_name != "tensorwise":
            for key in ("enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp",
                        "force_recompute_fp8_weight_in_bwd"):
                if getattr(self, key):
                    raise ConfigError(f"fp8.{key}: true needs fp8.recipe_name tensorwise (got {self.recipe_name!r}: "
                                      "its scales are per row); allowed with it: false")
        if self.precompute_float8_dynamic_scale_for_fsdp and not self.enable_fsdp_float8_all_gather:
            raise ConfigError("fp8.precompute_float8_dynamic_scale_for_fsdp: true computes the scales of the weights "
                              "FSDP2 gathers in FP8; set fp8.enable_fsdp_float8_all_gather: true too, or set it false")
        return self


def apply_fp8(model: nn.Module, cfg: FP8Config, device: torch.device | str, *, check_device: bool = True) -> int:
    """Swap ``model``'s eligible linear layers for torchao's ``Float8Linear`` in place (before checkpointing, LoRA
    and FSDP2 wrap them); return how many. `ConfigError` in one line when torchao is missing, the device has no FP8
    matrix multiply and ``emulate`` is off (unless not ``check_device``: the estimate's fake model of a GPU run), or
    no layer is eligible (FP8 that changes nothing is an error)."""
    import torch

    if check_device:
        check_fp8_device(cfg, torch.device(device))
    Float8LinearConfig, convert_to_float8_training = _torchao()
    if cfg.recipe_name == "tensorwise":
        options = Float8LinearConfig(enable_fsdp_float8_all_gather=cfg.enable_fsdp_float8_all_gather,
                                     force_recompute_fp8_weight_in_bwd=cfg.force_recompute_fp8_weight_in_bwd,
                                     emulate=cfg.emulate)
    else:
        options = dataclasses.replace(Float8LinearConfig.from_recipe_name(cfg.recipe_name), emulate=cfg.emulate)
    chosen = [name for name, module in model.named_modules() if _eligible(module, name, cfg.filter_fqns)]
    if not chosen:
        raise ConfigError(f"fp8.enabled: no linear layer of {type(model).__name__} can run in FP8 (both dimensions "
                          f"multiples of 16, name without {cfg.filter_fqns}); allowed: fp8.enabled: false")
    convert_to_float8_training(model, config=options, module_filter_fn=lambda m, n: n in set(chosen))
    logger.info("fp8: %d linear layers in FP8 (torchao, %s scaling%s)", len(chosen), cfg.recipe_name,
                ", emulated" if cfg.emulate else "")
    return len(chosen)


def after_optimizer_step(model: nn.Module, cfg: FP8Config) -> None:
    """What an FP8 model needs after each optimizer step: the FP8 scales of all FSDP2-sharded weights at once
    (``precompute_float8_dynamic_scale_for_fsdp``), instead of one all-reduce per layer in the next forward."""
    if cfg.enabled and cfg.precompute_float8_dynamic_scale_for_fsdp:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def _torchao() -> tuple[Any, Any]:
    """torchao's float8 training API; `ConfigError` saying how to install it."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ConfigError(f"fp8.enabled: true needs torchao ({err}); install it: pip install 'remat[fp8]'") from None
    return Float8LinearConfig, convert_to_float8_training


def _eligible(module: Any, name: str, filter_fqns: list[str]) -> bool:
    from torch import nn

    if type(module) is not nn.Linear or any(fqn in name for fqn in filter_fqns):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def check_fp8_device(cfg: FP8Config, device: torch.device) -> None:
    """`ConfigError` in one line unless ``device`` runs ``cfg`` (FP8 matrix multiplies, or emulated ones)."""
    import torch

    if not cfg.enabled or cfg.emulate:
        return
    if device.type != "cuda":
        raise ConfigError(f"fp8.emulate: false needs FP8 matrix multiplies, which the {device.type} has not "
                          f"(a CUDA GPU of compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later); "
                          "allowed here: fp8.emulate: true (the same casts, ordinary matrix multiplies), or "
                          "fp8.enabled: false")
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ConfigError(f"fp8.emulate: false needs FP8 matrix multiplies: {torch.cuda.get_device_name(device)} has "
                          f"compute capability {capability[0]}.{capability[1]}, FP8 needs {FP8_CAPABILITY[0]}."
                          f"{FP8_CAPABILITY[1]} or later; allowed here: fp8.emulate: true, or fp8.enabled: false")
