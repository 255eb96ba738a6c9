"""The planner choosing the loss: with ``activation_checkpointing.loss: choose`` (``loss_choice="choose"`` in Python,
``remat plan --loss-choice choose``), the step is planned for the plain loss (`remat.loss.MaskedCrossEntropy`, the
logits held) and the fused loss (`remat.loss.FusedLinearCrossEntropy`, never holding them) under the same budget,
and the faster plan that fits wins.

Predicted time of each: its recompute and host copies (`ActivationPlan`), plus the loss's own FLOPs beyond the plain
loss's at the same throughput. A loss's FLOPs (output projection and cross-entropy, forward and backward) are
counted once per loss with torch's ``FlopCounterMode`` on fake tensors, as the step runs it: the fused loss that
recomputes the logits in backward (``grad_strategy: recompute``, which ``auto`` takes for a bf16 weight over several
token chunks off the CUDA fast path) counts that extra matmul, and it skips the tokens without a label, which the
plain loss's logits include. The recipe's own loss is kept unless the other is faster by more than `NEAR_TIE` of the
step's predicted compute time; otherwise equal times go to the plan with fewer recomputed FLOPs.
The recipe's loss arguments carry over (`carried_loss_kwargs`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from remat.errors import ConfigError
from remat.estimate.choices import LOSS_TARGETS, short_loss
from remat.estimate.run import SimulatedRun
from remat.estimate.simulate import make_batch, simulation_mode, with_cuda_loss_defaults
from remat.models.build import resolve_model_config
from remat.planner.planner import Planner
from remat.planner.result import ActivationPlan
from remat.recipes.build import build_loss
from remat.recipes.config import RecipeConfig
from remat.recipes.loader import with_loss

LOSS_CHOICES: Final[tuple[str, ...]] = ("keep", "choose")
"""``keep``: plan for the recipe's own loss; ``choose``: plan for the plain and the fused loss, keep the faster."""

_KEY = "distributed.activation_checkpointing.loss"


def check_loss_choice(value: object, key: str = "loss_choice") -> str:
    """``value`` when it is one of `LOSS_CHOICES`, else one `ConfigError` naming ``key``."""
    if value not in LOSS_CHOICES:
        raise ConfigError(f"{key}: got {value!r}; allowed: {', '.join(LOSS_CHOICES)}")
    return str(value)


def check_choosable(loss: str) -> str:
    """``loss`` short (``plain`` / ``fused``) when ``choose`` can pick it or the other, else one `ConfigError`."""
    short = short_loss(loss)
    if short not in LOSS_TARGETS:
        raise ConfigError(f"{_KEY}: choose picks between {LOSS_TARGETS['plain']} and {LOSS_TARGETS['fused']}; "
                          f"the recipe's loss_fn._target_ is {short!r}; use {_KEY}: keep")
    return short


_FUSED_KNOBS: Final[frozenset[str]] = frozenset({"chunk_size", "grad_strategy", "chunk_bytes", "backend", "compile"})
"""Arguments of the fused loss that set how it runs, not what it computes: dropped when the plain loss is chosen."""


def carried_loss_kwargs(kwargs: Mapping[str, Any], loss: str) -> dict[str, Any]:
    """The recipe's loss arguments for ``loss`` (``plain`` / ``fused``): those its class takes; the fused loss's
    execution settings (`_FUSED_KNOBS`) are dropped for the plain loss; any other argument the class does not take
    (``logit_softcap`` changes the loss itself) is one `ConfigError`."""
    from remat.loss import FusedLinearCrossEntropy, MaskedCrossEntropy

    cls = {"plain": MaskedCrossEntropy, "fused": FusedLinearCrossEntropy}[loss]
    taken = set(inspect.signature(cls.__init__).parameters) - {"self"}
    for name in kwargs:
        if name not in taken and not (loss == "plain" and name in _FUSED_KNOBS):
            raise ConfigError(f"{_KEY}: choose cannot give the {loss} loss ({LOSS_TARGETS[loss]}) the recipe's "
                              f"loss_fn.{name} (it takes {', '.join(sorted(taken))}); remove loss_fn.{name} or use "
                              f"{_KEY}: keep")
    return {name: value for name, value in kwargs.items() if name in taken}


def count_loss_flops(recipe: RecipeConfig, run: SimulatedRun) -> int:
    """Forward plus backward FLOPs of the output projection and ``recipe``'s loss for one micro-batch, counted on
    fake tensors (per micro-batch; the output projection's weight in the parameter dtype)."""
    if run.target == "cuda":
        recipe = with_cuda_loss_defaults(recipe)
    text = resolve_model_config(recipe.model).get_text_config()
    vocab = int(run.vocab_size or text.vocab_size)
    hidden_size = int(text.hidden_size)
    batch = make_batch(recipe, run, vocab)
    loss_fn = build_loss(recipe)
    dtype = getattr(torch, recipe.model.dtype)
    shape = (*batch["labels"].shape, hidden_size)
    with FakeTensorMode(allow_non_fake_inputs=True), simulation_mode(run.target):
        hidden = torch.empty(shape, dtype=dtype, requires_grad=True)
        weight = torch.empty((vocab, hidden_size), dtype=dtype, requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            if getattr(loss_fn, "consumes", "logits") == "hidden_states":
                loss = loss_fn(hidden, weight, batch["labels"])
            else:
                loss = loss_fn(F.linear(hidden, weight), batch["labels"])
            loss.backward()
    return int(counter.get_total_flops())


NEAR_TIE = 0.01
"""The recipe's own loss is kept unless the other's predicted extra time is lower by more than this share of the
step's predicted compute time (a time model of FLOPs at one throughput cannot tell closer cases apart)."""


@dataclass
class LossChooser:
    """Plans ``recipe``'s step for the plain and the fused loss (one `Planner` each, made by ``planner_for`` from a
    copy of the recipe with that loss, `remat.recipes.loader.with_loss`, when first needed) and answers each budget
    with the faster fitting plan (see the module docstring)."""

    recipe: RecipeConfig
    planner_for: Callable[[RecipeConfig], Planner]
    _planners: dict[str, Planner] = field(init=False, default_factory=dict)
    _flops: dict[str, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.own_loss = check_choosable(self.recipe.loss_fn.target)
        loss_fn = self.recipe.loss_fn
        self.recipes = {loss: with_loss(self.recipe, recipe_loss_fn(loss_fn.target, loss_fn.kwargs, loss))
                        for loss in self.losses}

    @property
    def losses(self) -> tuple[str, ...]:
        """The recipe's own loss first, then the other."""
        return (self.own_loss, *(loss for loss in LOSS_TARGETS if loss != self.own_loss))

    def planner(self, loss: str) -> Planner:
        """The planner of the step with ``loss`` (made once)."""
        if loss not in self._planners:
            planner = self._planners[loss] = self.planner_for(self.recipes[loss])
            self._flops[loss] = count_loss_flops(planner.recipe, planner.run)
        return self._planners[loss]

    def loss_flops(self, loss: str) -> int:
        """The FLOPs of ``loss`` (output projection included) per optimizer step."""
        planner = self.planner(loss)
        return self._flops[loss] * planner.accumulation

    def plan(self, budget_bytes: int, *, all_candidates: bool = False) -> ActivationPlan:
        """The faster fitting plan of the two losses for ``budget_bytes``; when neither fits, the recipe's own
        loss's "nothing fits" error, with what the other loss would need."""
        plans: list[ActivationPlan] = []
        errors: dict[str, ConfigError] = {}
        for loss in self.losses:
            try:
                plans.append(self.planner(loss).plan(budget_bytes, all_candidates=all_candidates))
            except ConfigError as err:
                errors[loss] = err
        if not plans:
            own, other = self.losses
            raise ConfigError(f"{errors[own]}. With the {other} loss ({_KEY}: choose tried it): {errors[other]}")
        baseline = self.loss_flops("plain")

        def rank(plan: ActivationPlan) -> tuple[float, int, int]:
            extra = (self.loss_flops(plan.loss) - baseline) / plan.flops_per_second
            return (plan.recompute_seconds + plan.transfer_seconds + extra, plan.recompute_flops,
                    self.losses.index(plan.loss))

        best = min(plans, key=rank)
        own = next((p for p in plans if p.loss == self.own_loss), None)
        if own is not None and own is not best:  # the recipe's own loss unless the other is faster by a margin
            step_seconds = best.step_flops / best.flops_per_second
            if rank(own)[0] - rank(best)[0] <= NEAR_TIE * step_seconds:
                best = own
        others = "; ".join(
            f"{p.loss}: {rank(p)[0]:.4g} s" for p in plans if p is not best
        ) or "; ".join(f"{loss}: nothing fits" for loss in errors)
        note = (f"loss chosen by the planner ({_KEY}: choose): {best.loss} ({LOSS_TARGETS[best.loss]}); predicted "
                f"extra time (recompute, host copies, loss FLOPs beyond the plain loss's): {best.loss}: "
                f"{rank(best)[0]:.4g} s; {others}")
        return dataclasses.replace(best, notes=(*best.notes, note))


def recipe_loss_fn(target: str, kwargs: Mapping[str, Any], loss: str) -> dict[str, Any]:
    """The recipe's ``loss_fn`` section for ``loss`` (its arguments carried over, see `carried_loss_kwargs`)."""
    if short_loss(target) == loss:
        return {"_target_": target, **kwargs}
    return {"_target_": LOSS_TARGETS[loss], **carried_loss_kwargs(kwargs, loss)}
