"""THE training step: forward+backward of each micro-batch (the loss normalised by the step's label tokens summed
over the data-parallel ranks), gradient synchronisation on the last micro-batch, gradient clipping, the numerics guard
(`remat.recipes.run_safety.numerics`: a step whose loss or gradient norm is NaN/inf is not applied), the optimizer step, the
learning-rate schedule and ``zero_grad``.

`remat.recipes.finetune.FinetuneRecipe` runs it on real tensors; the memory estimate (`remat.estimate.simulate`) runs
it under ``FakeTensorMode``; `benchmarks/bench_estimate_cuda.py` runs it on a GPU. Nothing here reads a tensor's
value (no ``.item()``), so the same code runs on fake tensors: the loss and the gradient norm stay on the device.
The one host sync left is the guard's for optimizers that cannot skip an update on the device (see
`remat.recipes.run_safety.numerics.step_unless`); fused Adam/AdamW/SGD skip it with ``found_inf``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from remat.distributed import DistributedSetup
from remat.distributed.grad_norm import clip_grad_norm_tensor
from remat.recipes.model_loss import count_label_tokens
from remat.recipes.run_safety.numerics import nonfinite_flag, step_unless

UPDATE_PHASE: Final[str] = "optimizer step"
"""The phase `train_step` marks before clipping and the update (re-planning watches it; the estimate stops there)."""

Batch = Mapping[str, torch.Tensor]


@dataclass
class StepOutcome:
    """What one step produced: this rank's summed micro-batch losses and the gradient norm before clipping (both
    0-dim tensors: convert them after the step), the learning rate it stepped with, the step's label tokens, and
    ``skipped``: 1.0 (a 0-dim tensor, the same on every rank) when the loss or norm was NaN/inf and the optimizer's
    update was not applied (the learning-rate schedule still moved on)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    label_tokens: int
    skipped: torch.Tensor


def step_label_tokens(micro_batches: Sequence[Batch], setup: DistributedSetup) -> int:
    """The label tokens of one step: this rank's micro-batches, summed over the data-parallel ranks (a collective:
    call it on every rank, before the step)."""
    local = sum(count_label_tokens(batch["labels"]) for batch in micro_batches)
    return int(setup.sum_over_dp([local])[0])


def autocast(dtype: str | None, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` to ``dtype`` (a torch dtype name), or nothing when None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))


def train_step(
    root: Callable[..., torch.Tensor],
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Batch],
    *,
    setup: DistributedSetup,
    label_tokens: int,
    autocast_dtype: str | None,
    max_norm: float | None,
    lr_scheduler: Any = None,
    mark: Callable[[str], None] = lambda label: None,
    after_update: Callable[[], None] | None = None,
) -> StepOutcome:
    """One optimizer step over ``micro_batches`` (already on the device).

    ``root`` is the module `remat.recipes.build.build_training_module` returned, ``params`` the model's parameters
    (the gradient norm is taken over them), ``label_tokens`` the step's count from `step_label_tokens`.
    ``max_norm`` None measures the norm without clipping. ``mark`` is called with each phase's name as it starts
    (the estimate records its phases with it). ``after_update`` runs after the optimizer step (FP8's scales).
    """
    # DDP and FSDP2 average gradients over the ranks holding a share of the batch (dp x cp); each rank's loss is its
    # share of the global sum (over the global label-token count): scaling by their number turns that into the sum.
    grad_scale = float(setup.shard_count)
    device_type = micro_batches[0]["input_ids"].device.type
    total_loss: torch.Tensor | None = None
    count = len(micro_batches)
    for index, batch in enumerate(micro_batches):
        suffix = f" (micro-batch {index + 1})" if count > 1 else ""
        mark("forward" + suffix)
        with setup.gradient_sync(enabled=index == count - 1):
            with autocast(autocast_dtype, device_type):
                loss = root(batch, num_label_tokens=max(label_tokens, 1))
            mark("backward" + suffix)
            (loss * grad_scale if grad_scale != 1.0 else loss).backward()
        part = loss.detach().float()
        total_loss = part if total_loss is None else total_loss + part
        del loss
    mark(UPDATE_PHASE)
    grad_norm = clip_grad_norm_tensor(params, max_norm)
    assert total_loss is not None, "train_step needs at least one micro-batch"
    lr = float(optimizer.param_groups[0]["lr"])
    skipped = nonfinite_flag(total_loss, grad_norm, setup)
    step_unless(optimizer, skipped)
    if after_update is not None:  # also after a skipped step: recomputing scales of unchanged weights is harmless
        after_update()
    if lr_scheduler is not None:
        lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepOutcome(loss=total_loss, grad_norm=grad_norm, lr=lr, label_tokens=label_tokens, skipped=skipped)
