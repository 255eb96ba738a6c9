"""`apply_activation_checkpointing`: find the blocks, resolve the policy into a plan, wrap the modules, and switch
off the KV cache; `remove_activation_checkpointing` undoes it.

Wrapping patches ``forward`` on the module instances (see `remat.checkpointing.wrappers`): no module is replaced,
so parameter names, ``state_dict`` keys and ``save_pretrained`` weights are unchanged, and ``fully_shard`` or
``torch.compile`` can be applied to the wrapped blocks afterwards.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import replace
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from remat.checkpointing.discovery import find_blocks, find_final_norms
from remat.checkpointing.hf_native import hf_method
from remat.checkpointing.plan import CheckpointPlan, LayerPlan, planned_policy
from remat.checkpointing.policy import PolicyLike, merge_options, parse_policy
from remat.checkpointing.resolve import resolve_plan
from remat.checkpointing.segments import Segment
from remat.checkpointing.selective import selective_context_fn
from remat.checkpointing.tiling import TiledRunner
from remat.checkpointing.wrappers import (
    CheckpointRunner,
    OffloadRunner,
    Runner,
    is_wrapped,
    unwrap_forward,
    wrap_forward,
)
from remat.errors import CheckpointingError

logger = logging.getLogger(__name__)

#: The attribute on the model that remembers the ``use_cache`` values switched off: [(module name, value)].
_USE_CACHE_ATTR = "_remat_use_cache_before"
_RECOMPUTING_MODES = frozenset({"full", "selective", "attention", "mlp"})


def apply_activation_checkpointing(
    model: nn.Module,
    policy: PolicyLike = "full",
    *,
    offload_context: AbstractContextManager[Any] | None = None,
    **options: Any,
) -> CheckpointPlan:
    """Apply an activation-checkpointing policy to ``model`` in place and return what was done, block by block.

    ``policy`` takes every form `parse_policy` accepts (``True``, ``"full"``, ``"selective"``, ``"sqrt"``,
    ``{"mode": "full", "every_n_layers": 2}``, a `CheckpointPolicy`, ...); ``options`` override its fields
    (``apply_activation_checkpointing(model, "full", every_n_layers=2)``). ``offload_context`` is the re-enterable
    saved-tensor-hooks context used by offloading policies (default: an `OffloadActivations` that treats the
    model's parameters and buffers as resident).

    Raises `CheckpointingError` when the model is already checkpointed (by remat, by transformers'
    ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable``, or by torch's ``checkpoint_wrapper``),
    when no blocks are found, or when the policy would wrap nothing. ``policy="none"`` returns an empty plan and
    leaves the model untouched.
    """
    parsed = merge_options(parse_policy(policy), options)
    model_class = type(model).__name__
    if not parsed.enabled:
        return CheckpointPlan.empty(parsed, model_class, "policy 'none': nothing wrapped")
    _refuse_double_wrapping(model)
    search = find_blocks(model, parsed.block_pattern)
    with planned_policy(getattr(policy, "checkpoint_policy", None) is not None):  # a planner's plan: its own notes
        plan = resolve_plan(parsed, search, model_class)

    offload = None
    if any(layer.offload for layer in plan.layers):
        offload = offload_context if offload_context is not None else _default_offload_context(model)
    modules = dict(model.named_modules())
    runners = _runners(plan, offload)
    outside = _tiled_final_norms(model, search, plan)
    runners.update(outside)
    for name, runner in runners.items():
        wrap_forward(modules[name], runner)
    _watch_first_run(modules, plan)
    plan = replace(plan, notes=_wrapped_notes(model, plan, outside), offload_context=offload,
                   tiled_outside=tuple(outside))
    logger.info("activation checkpointing: %s", plan.summary())
    for note in plan.notes:
        logger.info("activation checkpointing: %s", note)
    return plan


def _watch_first_run(modules: dict[str, nn.Module], plan: CheckpointPlan) -> None:
    """Check, the first time each block runs, that the sub-modules wrapped in it (its attention or MLP) were called:
    a block that reaches them another way (indexing the members of an ``nn.ModuleList`` it holds, say) would leave
    the wrapped forward unused, and the policy would recompute nothing there while the plan says it does.

    # NOTE [ Checking what ran, not what was wrapped ]
    # `resolve_plan` refuses a policy that wraps nothing, but wrapping a module does not make the block call it.
    # The check runs once per block, on its first forward (hooks that remove themselves), so steps after the first
    # pay nothing; under torch.compile the hooks do nothing (the eager first steps of other runs cover the model), nor
    # after the estimate compiled the block's forward (`_compiled_forward`).
    """
    called: set[str] = set()
    for layer in plan.layers:
        inner = [name for name in layer.wrapped if name != layer.name]
        if not inner or layer.name not in modules:
            continue
        handles = [modules[name].register_forward_pre_hook(_mark_called(called, name)) for name in inner]
        check = _check_called(called, layer.name, inner, plan, handles)
        handles.append(modules[layer.name].register_forward_hook(check))


def _mark_called(called: set[str], name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            called.add(name)
    return hook


def _check_called(called: set[str], block: str, inner: list[str], plan: CheckpointPlan,
                  handles: list[Any]) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or _compiled_forward(module):
            return
        for handle in handles:  # once per block: later steps pay nothing
            handle.remove()
        missed = [name for name in inner if name not in called]
        if missed:
            raise CheckpointingError(
                f"policy {plan.policy.describe()!r} wrapped {', '.join(missed)}, but {block} ran without calling "
                f"{'it' if len(missed) == 1 else 'them'} (it reaches its members another way): nothing would be "
                "recomputed there; allowed: a policy that wraps whole blocks (full, selective, sqrt, offload)")
    return hook


def _compiled_forward(module: nn.Module) -> bool:
    """Whether ``module``'s forward itself was compiled (the estimate compiles a block's forward, not its call, so
    its hooks stay eager: `remat.estimate.compiled`); its sub-modules' hooks then ran while dynamo traced."""
    return hasattr(module.__dict__.get("forward"), "_torchdynamo_orig_callable")


def remove_activation_checkpointing(model: nn.Module) -> int:
    """Undo `apply_activation_checkpointing`: restore every wrapped forward and the ``use_cache`` values that were
    switched off. Returns how many modules were unwrapped (0 when none was)."""
    count = sum(unwrap_forward(module) for module in model.modules())
    saved = model.__dict__.pop(_USE_CACHE_ATTR, [])
    modules = dict(model.named_modules())
    for name, value in saved:
        config = getattr(modules.get(name), "config", None)
        if config is not None:
            config.use_cache = value
    return count


def is_checkpointed(model: nn.Module) -> bool:
    """True when remat wrapped any module of ``model``."""
    return any(is_wrapped(module) for module in model.modules())


# --- helpers -----------------------------------------------------------------------------------------------------


def _runners(plan: CheckpointPlan, offload: AbstractContextManager[Any] | None) -> dict[str, Runner]:
    segments = {
        span: Segment(span[0], span[1], tuple(plan.layers[i].name for i in range(span[0], span[1] + 1)))
        for span in plan.segments
        if span[1] > span[0]
    }
    runners: dict[str, Runner] = {}
    for layer in plan.layers:
        layer_offload = offload if layer.offload else None
        for name in layer.wrapped:
            if name in layer.tiled:
                runners[name] = TiledRunner(layer.tile_tokens, f"{name} in block {layer.index}")
            else:
                runners[name] = _runner_for(layer, layer_offload, segments)
    return runners


def _tiled_final_norms(model: nn.Module, search: Any, plan: CheckpointPlan) -> dict[str, Runner]:
    """With tiled blocks, the per-position norms after the last block (`find_final_norms`) run over chunks of the
    same length: an RMSNorm that upcasts (Llama's) otherwise keeps a fp32 ``[tokens, hidden]`` copy for backward,
    the largest full-length tensor outside the blocks at long sequence."""
    tiled = [layer for layer in plan.layers if layer.tiled]
    if not tiled:
        return {}
    return {name: TiledRunner(tiled[-1].tile_tokens, f"{name} (the final norm)")
            for name in find_final_norms(model, search)}


def _runner_for(
    layer: LayerPlan,
    offload: AbstractContextManager[Any] | None,
    segments: dict[tuple[int, int], Segment],
) -> Runner:
    if layer.segment is not None and layer.segment in segments:
        return segments[layer.segment].member(layer.index - layer.segment[0])
    if layer.mode == "selective":
        return CheckpointRunner(selective_context_fn(), offload)
    if layer.mode == "offload":
        if offload is None:
            raise AssertionError("an offload layer without an offload context")
        return OffloadRunner(offload)
    return CheckpointRunner(None, offload)


def _default_offload_context(model: nn.Module) -> AbstractContextManager[Any]:
    from remat.checkpointing.offload import OffloadActivations

    return OffloadActivations(module=model)


def _wrapped_notes(model: nn.Module, plan: CheckpointPlan, outside: Mapping[str, Any]) -> tuple[str, ...]:
    """The plan's notes and what wrapping did besides: final norms tiled outside the blocks, ``use_cache`` switched
    off where blocks are recomputed."""
    notes = list(plan.notes)
    if outside:
        notes.append(f"the final norm ({', '.join(outside)}) runs over chunks of the tokens too: its fp32 copy of the "
                     "hidden states exists one chunk at a time")
    if any(layer.mode in _RECOMPUTING_MODES for layer in plan.layers):
        switched = _switch_off_use_cache(model)
        if switched:
            notes.append(
                f"use_cache set to False on {', '.join(switched)}: recomputed blocks must not write a KV cache a "
                "second time; remove_activation_checkpointing() restores it"
            )
    return tuple(notes)


def _refuse_double_wrapping(model: nn.Module) -> None:
    cls = type(model).__name__
    ours = [name for name, module in model.named_modules() if is_wrapped(module)]
    if ours:
        raise CheckpointingError(
            f"activation checkpointing is already applied to {cls} by remat ({len(ours)} modules, e.g. "
            f"{ours[0]!r}); applying it again would recompute blocks twice. To change the policy, call "
            "remat.checkpointing.remove_activation_checkpointing(model) first"
        )
    hf = [
        name or "<root>"
        for name, module in model.named_modules()
        if getattr(module, "gradient_checkpointing", False) is True
    ]
    if hf:
        raise CheckpointingError(
            f"transformers' own activation checkpointing is already on in {cls} ({len(hf)} modules, e.g. "
            f"{hf[0]!r}), enabled by gradient_checkpointing_enable() / activation_checkpointing_enable() (peft's "
            "prepare_model_for_kbit_training does this by default); both together would recompute blocks twice. "
            f"Call model.{hf_method(model, 'disable')}() first, or keep transformers' and skip remat's"
        )
    torch_wrapped = [name for name, module in model.named_modules() if type(module).__name__ == "CheckpointWrapper"]
    if torch_wrapped:
        raise CheckpointingError(
            f"{cls} already has torch checkpoint_wrapper modules ({len(torch_wrapped)}, e.g. {torch_wrapped[0]!r}); "
            "remove them before applying remat's policy, or apply only one of the two"
        )


def _switch_off_use_cache(model: nn.Module) -> list[str]:
    """Set ``config.use_cache = False`` on every module config that has it True; remember the old values."""
    switched: list[str] = []
    saved: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or not hasattr(config, "use_cache"):
            continue
        seen.add(id(config))
        if config.use_cache:
            saved.append((name, config.use_cache))
            config.use_cache = False
            switched.append(f"{type(config).__name__} ({name or '<root>'})")
    if saved:
        model.__dict__[_USE_CACHE_ATTR] = saved
    return switched

