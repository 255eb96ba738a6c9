"""How a module is wrapped: its ``forward`` is replaced *on the instance* by one that runs the original under
non-reentrant ``torch.utils.checkpoint`` (optionally with a selective ``context_fn``), under an offloading context,
or as part of a segment.

The module stays where it is, so parameter names, ``state_dict`` keys and ``save_pretrained`` output do not change,
and ``fully_shard`` / ``torch.compile`` can be applied to the same module afterwards: module hooks (FSDP2's
all-gather) run in ``__call__``, outside the checkpointed region, and are not run again by the recompute.
The wrapped forward only checkpoints while the module is training and gradients are enabled; in eval or under
``no_grad`` it calls the original forward directly.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

WrapKind = Literal["checkpoint", "offload", "segment", "tiled"]
ContextFn = Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]

#: The attribute on a wrapped module that holds its `WrapState`.
STATE_ATTR = "_remat_checkpoint"
#: Keyword arguments through which a layer would update a KV cache (names differ across architectures).
_CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past")
#: Keyword names under which a sub-module (e.g. an attention module called with keywords only) gets its input.
_INPUT_KWARGS = ("hidden_states", "hidden_state", "x", "input")
_warned_cache: set[str] = set()


@dataclass
class WrapState:
    """What a wrapped module does instead of its forward, and what to restore on unwrap.

    ``inner`` is the forward that was in effect before wrapping (an instance-level forward set by someone else, or
    the class's forward bound to the module); ``runner`` runs it for one call while training. Everything is plain
    data or bound methods, so ``copy.deepcopy`` of a wrapped model gives an independent wrapped copy.
    """

    inner: Callable[..., Any]
    had_instance_forward: bool
    runner: Runner


def is_wrapped(module: nn.Module) -> bool:
    """True when remat wrapped this module's forward."""
    return STATE_ATTR in module.__dict__


def wrap_state(module: nn.Module) -> WrapState | None:
    """The module's `WrapState`, or None when it is not wrapped by remat."""
    return module.__dict__.get(STATE_ATTR)


def wrap_forward(module: nn.Module, runner: Runner) -> None:
    """Replace ``module.forward`` on the instance by a forward that calls ``runner(module, inner, args, kwargs)``
    while training with gradients enabled (``inner`` being the forward in effect before)."""
    if is_wrapped(module):
        raise AssertionError(f"{type(module).__name__} is already wrapped by remat")  # apply checks this first
    had_instance_forward = "forward" in module.__dict__
    inner = module.__dict__["forward"] if had_instance_forward else types.MethodType(type(module).forward, module)
    module.__dict__[STATE_ATTR] = WrapState(inner, had_instance_forward, runner)
    module.forward = types.MethodType(_wrapped_forward, module)  # type: ignore[method-assign]


def unwrap_forward(module: nn.Module) -> bool:
    """Restore the forward that was in effect before `wrap_forward`; False when the module was not wrapped."""
    state = module.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return False
    if state.had_instance_forward:
        module.forward = state.inner  # type: ignore[method-assign]
    else:
        del module.forward
    return True


def _wrapped_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: WrapState = self.__dict__[STATE_ATTR]
    if not (self.training and torch.is_grad_enabled()):
        return state.inner(*args, **kwargs)
    if state.runner.recomputes:
        kwargs = _without_cache_updates(self, kwargs)
    return state.runner(self, state.inner, args, kwargs)


def _without_cache_updates(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drop a KV cache passed to a recomputed module: the recompute would write it a second time."""
    dropped = [k for k in _CACHE_KWARGS if kwargs.get(k) is not None]
    if not dropped and not kwargs.get("use_cache"):
        return kwargs
    kwargs = dict(kwargs)
    for k in dropped:
        kwargs[k] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    cls = type(module).__name__
    if cls not in _warned_cache:
        _warned_cache.add(cls)
        logger.warning(
            "%s is recomputed in backward, so it must not update a KV cache: dropped %s for this call while "
            "training (set use_cache=False to silence this)", cls, ", ".join(dropped) or "use_cache=True",
        )
    return kwargs


# --- runners -----------------------------------------------------------------------------------------------------


class Runner:
    """Runs one call of a wrapped module's original forward (``inner``) while training. Subclasses say how."""

    kind: WrapKind
    recomputes: bool

    def __call__(
        self, module: nn.Module, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        raise NotImplementedError


class CheckpointRunner(Runner):
    """Recompute the module in backward with non-reentrant ``torch.utils.checkpoint``.

    ``context_fn`` (e.g. `remat.checkpointing.selective.selective_context_fn()`) makes it selective; ``offload``
    (a re-enterable context manager with saved-tensor hooks, e.g. `OffloadActivations`) is entered around the
    checkpoint, so the input that checkpoint keeps is offloaded as well.
    """

    kind: WrapKind = "checkpoint"
    recomputes = True

    def __init__(self, context_fn: ContextFn | None = None, offload: AbstractContextManager[Any] | None = None) -> None:
        self.context_fn = context_fn
        self.offload = offload

    def __deepcopy__(self, memo: dict[int, Any]) -> CheckpointRunner:
        return CheckpointRunner(self.context_fn, self.offload)  # the offload context is shared, not copied

    def __call__(
        self, module: nn.Module, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        fn, args, kwargs = input_as_positional(inner, args, kwargs)
        with self.offload if self.offload is not None else nullcontext():
            # No context_fn argument at all without one: torch.compile's checkpoint support expects that.
            if self.context_fn is None:
                return checkpoint(fn, *args, use_reentrant=False, **kwargs)
            return checkpoint(fn, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs)


class OffloadRunner(Runner):
    """Recompute nothing: run the module inside ``offload``, whose hooks keep what it saves in host memory."""

    kind: WrapKind = "offload"
    recomputes = False

    def __init__(self, offload: AbstractContextManager[Any]) -> None:
        self.offload = offload

    def __deepcopy__(self, memo: dict[int, Any]) -> OffloadRunner:
        return OffloadRunner(self.offload)  # the offload context is shared, not copied

    def __call__(
        self, module: nn.Module, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        with self.offload:
            return inner(*args, **kwargs)


def input_as_positional(
    inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """Pass a keyword-only input (``hidden_states=...``) to checkpoint positionally: returns (fn, args, kwargs).

    Non-reentrant checkpoint keeps its positional tensors as saved tensors, which an enclosing offloading context
    sees; keyword arguments are held by a closure that it does not. Only the input moves: masks and position
    embeddings are shared by every layer and would be copied once per layer.
    """
    if any(isinstance(a, torch.Tensor) for a in args):
        return inner, args, kwargs
    for name in _INPUT_KWARGS:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor):
            rest = {k: v for k, v in kwargs.items() if k != name}

            def with_input(input_value: torch.Tensor, *more: Any, **more_kwargs: Any) -> Any:
                return inner(*more, **{name: input_value}, **more_kwargs)

            return with_input, (value, *args), rest
    return inner, args, kwargs
