"""THE build of a recipe: the distributed setup, the model (+LoRA), the loss module the step calls (activation
checkpointing and the data-parallel wrapper applied by `DistributedSetup.parallelize`) and the optimizer.

`remat.recipes.finetune.FinetuneRecipe` builds with these functions on real tensors; the memory estimate
(`remat.estimate.simulate`) builds with the same functions under ``FakeTensorMode``. The model's outputs follow from
the loss: a loss that consumes hidden states gets the decoder's last hidden states and the output head
(`remat.loss.loss_input`).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from remat.checkpointing import CheckpointPolicy
from remat.checkpointing.discovery import find_blocks
from remat.distributed import DistributedSetup
from remat.errors import ConfigError
from remat.loss import loss_input
from remat.models import build_model
from remat.models.document_attention import use_document_attention
from remat.models.embedding_repair import repair_embedding_rows
from remat.models.fp8 import apply_fp8
from remat.models.qat import apply_qat
from remat.recipes.config import CompileConfig, PeftConfig, RecipeConfig
from remat.recipes.model_loss import CausalLMLoss
from remat.recipes.targets import LOSS, OPTIMIZER, build_target, resolve_target

logger = logging.getLogger(__name__)


def distributed_setup(cfg: RecipeConfig) -> DistributedSetup:
    """The run's `DistributedSetup`, from the recipe's validated ``distributed`` section."""
    return DistributedSetup.from_config(cfg.distributed)


def build_loss(cfg: RecipeConfig) -> Callable[..., torch.Tensor]:
    """The recipe's ``loss_fn``."""
    loss: Callable[..., torch.Tensor] = build_target(cfg.loss_fn.target, cfg.loss_fn.kwargs, key="loss_fn._target_",
                                                     kind=LOSS, custom_packages=cfg.custom_target_packages)
    return loss


def build_recipe_model(cfg: RecipeConfig, *, vocab_size: int | None, device: str = "cpu",
                       simulated: bool = False) -> nn.Module:
    """The recipe's model on ``device`` (its linear layers in FP8 with ``fp8.enabled``, `remat.models.fp8`, or fake
    quantised with ``qat.enabled``, `remat.models.qat`; NEFTune's noise on its embeddings with
    ``training.neftune_noise_alpha``; with LoRA adapters when it has a ``peft`` section, `apply_lora`); packed rows
    attend per document (``model.document_attention``, `remat.models.document_attention`). ``simulated``: built on
    fake tensors for the estimate of another device (FP8 is not refused for the CPU it is built on)."""
    model = build_model(cfg.model, vocab_size=vocab_size, device=device)
    if cfg.model.embedding_row_repair is not None and not simulated:  # the weights as loaded (fake ones hold none)
        repair_embedding_rows(model, cfg.model.embedding_row_repair)
    use_document_attention(model, cfg.model.document_attention, packed=cfg.dataset.packing)
    if cfg.fp8.enabled:  # before LoRA wraps the linear layers: the base layers run in FP8, the adapters do not
        apply_fp8(model, cfg.fp8, device, check_device=not simulated)
    if cfg.qat.enabled:  # NOTE [ Fake quantisation, and when it starts ] (remat.models.qat)
        apply_qat(model, cfg.qat, next(model.parameters()).dtype)
    if cfg.training.neftune_noise_alpha is not None:  # on the embedding module itself: LoRA keeps it
        from transformers.integrations.neftune import activate_neftune

        activate_neftune(model, cfg.training.neftune_noise_alpha)
    return apply_lora(model, cfg.peft) if cfg.peft is not None else model


BlockCompiler = Callable[[nn.Module, CheckpointPolicy], None]
"""What compiles a model's blocks once checkpointing wrapped them (`DistributedSetup.parallelize`'s
``after_checkpointing``)."""


def build_training_module(model: nn.Module, cfg: RecipeConfig, setup: DistributedSetup, *,
                          block_compiler: BlockCompiler | None = None) -> CausalLMLoss:
    """The loss module around ``model``, then ``setup.parallelize`` (checkpointing, TP, FSDP2 / DDP); returns the
    module the training step calls. The loss module is the root the wrappers wrap, so the loss (fused: with the
    output head's whole weight) runs inside the wrapper's forward. With the recipe's ``compile`` on, the blocks are
    compiled by `compile_blocks`, or by ``block_compiler`` when given (the estimate's simulated compile)."""
    loss_fn = build_loss(cfg)
    compute = CausalLMLoss(model, loss_fn, use_hidden_states=loss_input(loss_fn) == "hidden_states",
                           context=setup.context)
    compile_blocks = (block_compiler or _block_compiler(cfg.compile)) if cfg.compile.enabled else None
    root = setup.parallelize(model, root=compute, after_checkpointing=compile_blocks)
    return root  # type: ignore[return-value]


def _block_compiler(settings: CompileConfig) -> BlockCompiler:
    """`compile_blocks` with the recipe's ``compile`` settings, as `DistributedSetup.parallelize` calls it."""

    def compile_each(model: nn.Module, policy: CheckpointPolicy) -> None:
        compile_blocks(model, policy, backend=settings.backend, mode=settings.mode, fullgraph=settings.fullgraph,
                       dynamic=settings.dynamic)

    return compile_each


def compile_blocks(model: nn.Module, policy: CheckpointPolicy, *, backend: str = "inductor", mode: str | None = None,
                   fullgraph: bool = False, dynamic: bool | None = None) -> int:
    """``torch.compile`` of each decoder block of ``model`` (the blocks ``policy`` finds), after checkpointing wrapped
    it and before FSDP2 / DDP wrap the model (TorchTitan's order): the compiled region is the block with its
    checkpoint, so the compiler sees what is saved and what is recomputed. ``Module.compile`` keeps the module, its
    name and its parameters. Used by a recipe's ``compile`` section and by `remat.prepare_trainer` for
    ``TrainingArguments.torch_compile``; returns the number of blocks compiled."""
    blocks = find_blocks(model, policy.block_pattern).blocks
    for block in blocks:
        block.module.compile(backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    logger.info("torch.compile: %d blocks (backend %s%s)", len(blocks), backend, f", mode {mode}" if mode else "")
    return len(blocks)


def build_optimizer(cfg: RecipeConfig, params: Iterable[nn.Parameter], *,
                    foreach: bool | None = None) -> torch.optim.Optimizer:
    """The recipe's optimizer over ``params``. ``foreach`` (when the recipe chose neither ``foreach`` nor ``fused``
    and the optimizer accepts it) is passed on: the estimate of a CUDA step sets it, as PyTorch does by default for
    CUDA parameters."""
    kwargs = cfg.optimizer.kwargs
    if foreach is not None and not {"foreach", "fused"} & set(kwargs):
        optimizer_class = resolve_target(cfg.optimizer.target, key="optimizer._target_", kind=OPTIMIZER,
                                         custom_packages=cfg.custom_target_packages)
        if "foreach" in inspect.signature(optimizer_class).parameters:
            kwargs = {**kwargs, "foreach": foreach}
    optimizer: torch.optim.Optimizer = build_target(cfg.optimizer.target, kwargs, key="optimizer._target_",
                                                    kind=OPTIMIZER, custom_packages=cfg.custom_target_packages,
                                                    params=list(params))
    return optimizer


def apply_lora(model: nn.Module, cfg: PeftConfig) -> nn.Module:
    """``model`` with LoRA adapters from the ``peft`` section (only they are trained)."""
    from peft import LoraConfig, get_peft_model

    full_rank = max((min(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)),
                    default=0)
    if full_rank and cfg.r > full_rank:  # a rank above every layer's own adds nothing but memory (10**9: terabytes)
        raise ConfigError(f"peft.r: got {cfg.r}, more than the rank of any linear layer of {type(model).__name__} "
                          f"(at most {full_rank}: min(in, out) features); allowed: 1 to {full_rank}")
    pre = cfg.lora_dropout if cfg.dropout_position == "pre" else 0.0
    lora = LoraConfig(r=cfg.r, lora_alpha=cfg.lora_alpha, lora_dropout=pre,
                      target_modules=cfg.target_modules, exclude_modules=cfg.exclude_modules, task_type="CAUSAL_LM")
    try:
        with warnings.catch_warnings():  # peft asks transformers >= 5.2x by its deprecated name; nothing for users
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated",
                                    category=FutureWarning)
            adapted = get_peft_model(model, lora)
    except ValueError as err:
        raise ConfigError(f"peft: cannot apply LoRA to {type(model).__name__}: {err}") from err
    _nemo_lora(adapted, cfg)
    return adapted


# NOTE [ NeMo's LoRA on PEFT's adapters ]
# NeMo AutoModel's own LoRA starts each A Xavier-normal (PEFT: Kaiming-uniform) and drops out the adapter's output
# (PEFT: its input); B starts at zero in both, so the model starts the same. ``peft.lora_a_init: xavier_normal``
# draws A again after PEFT built it; ``dropout_position: post`` builds PEFT's adapters without dropout and drops out
# B's output in a forward hook (dropout and the scaling commute), which the checkpointed blocks replay with the same
# mask as any dropout. A recipe written for NeMo gets both, so it trains the adapters NeMo trains.
def _nemo_lora(model: nn.Module, cfg: PeftConfig) -> None:
    from peft.tuners.lora import LoraLayer

    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    for layer in layers:
        for name in layer.lora_A:
            if cfg.lora_a_init == "xavier_normal":
                nn.init.xavier_normal_(layer.lora_A[name].weight)
            if cfg.dropout_position == "post" and cfg.lora_dropout > 0:
                layer.lora_B[name].register_forward_hook(_output_dropout(cfg.lora_dropout))


def _output_dropout(p: float) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(output, p, module.training)

    return hook



#: LoRA options that change what a step holds in ways the planner's LoRA model (remat.recipes.build.apply_lora)
#: does not build: refused under policy="auto" (any fixed policy takes them).
_UNMODELLED_LORA: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("use_dora", lambda value: bool(value)), ("modules_to_save", lambda value: bool(value)),
    ("bias", lambda value: value not in (None, "none")), ("layers_to_transform", lambda value: value is not None),
    ("rank_pattern", lambda value: bool(value)), ("alpha_pattern", lambda value: bool(value)),
)


def lora_section(model: nn.Module, *, caller: str) -> dict[str, Any] | None:
    """The recipe's ``peft`` section of a PEFT LoRA model, so that ``auto`` plans the step it runs (frozen base,
    trainable adapters, the optimizer over the adapters only, as `apply_lora` builds it); None for a model without
    adapters. Adapters the planner cannot build the same way are refused in one line that starts with ``caller``."""
    from remat.models.quantization import is_quantized

    if is_quantized(model):
        raise ConfigError(f"{caller}: policy='auto' does not model 4-bit (bitsandbytes) weights yet; allowed: a fixed "
                          "policy (full, selective, attention, mlp, every_n, sqrt)")
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    if len(configs) != 1:
        raise ConfigError(f"{caller}: policy='auto' plans one LoRA adapter; this model has {len(configs)} "
                          f"({', '.join(map(repr, configs))}); allowed: one adapter, or a fixed policy")
    (name, config), = configs.items()
    kind = getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None))
    if kind != "LORA":
        raise ConfigError(f"{caller}: policy='auto' models LoRA adapters only; adapter {name!r} is {kind}; "
                          "allowed: a LoRA adapter, or a fixed policy")
    unmodelled = [option for option, set_ in _UNMODELLED_LORA if set_(getattr(config, option, None))]
    targets = config.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        unmodelled.append(f"target_modules as a pattern ({targets!r})")
    if unmodelled:
        raise ConfigError(f"{caller}: policy='auto' cannot model LoRA adapter {name!r} with "
                          f"{', '.join(unmodelled)}; allowed: plain LoRA (r, lora_alpha, lora_dropout, target_modules "
                          "as names or 'all-linear'), or a fixed policy")
    excluded = getattr(config, "exclude_modules", None)
    return {"method": "lora", "r": int(config.r), "lora_alpha": float(config.lora_alpha),
            "lora_dropout": float(config.lora_dropout),
            "target_modules": targets if isinstance(targets, str) else sorted(targets),
            **({"exclude_modules": excluded if isinstance(excluded, str) else sorted(excluded)} if excluded else {})}