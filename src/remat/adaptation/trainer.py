"""The Hugging Face Trainer's side of run-time adaptation under ``prepare_trainer(trainer, "auto")``: an
out-of-memory error in a step's first micro-batch is re-planned and that micro-batch retried (`MicroBatchRetry`, the
one-micro-batch mode of `remat.adaptation.retry.StepRetry`'s whole-step retry), and the plan is held against the
first step it predicts (`FirstStepCheck`). Both re-plan through the run's `remat.adaptation.adapter.PlanAdapter`,
free memory and swap the checkpointing as `StepRetry` does (`release_memory`, `swap_checkpointing`)."""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator
from typing import Any, Final

import torch
from torch import nn

from remat.adaptation.adapter import PlanAdapter
from remat.adaptation.relaxing import forward_backward_peak
from remat.adaptation.retry import OUT_OF_MEMORY, Overshoot, release_memory, size, swap_checkpointing
from remat.errors import ConfigError
from remat.training_state.layout import capture_rng_state, restore_rng_state

logger = logging.getLogger(__name__)

MAX_REPLANS: Final[int] = 3
"""Re-plans after out-of-memory errors in one Trainer run under ``auto`` (the recipe's ``max_replans`` default)."""


@contextlib.contextmanager
def leaving_no_trace(model: nn.Module) -> Iterator[None]:
    """Planning and the head probe leave the run as they found it: every random generator (torch CPU and CUDA,
    numpy, random) and the model's train/eval mode are put back, so a prepared run draws the same data order and
    dropout masks as the same run given the final plan by hand."""
    rng = capture_rng_state()
    training = model.training
    try:
        yield
    finally:
        restore_rng_state(rng)
        model.train(training)



# NOTE [ Which out-of-memory errors the Trainer retries ]
# remat's own loop retries a whole step; inside the Trainer's loop only the micro-batch that failed can run
# again, and only when nothing of it is left behind. Before the first micro-batch of a step the Trainer has
# zeroed the gradients to None, so dropping the gradients a failed forward or backward left puts the model
# exactly where it was; the generators are put back, so dropout draws the same masks. A later micro-batch of the
# same step (gradient accumulation) has the earlier ones' gradients in ``.grad`` and a partial backward added to
# some of them: it is not retried. Nor is an error on one of several processes, whose peers wait in the step's
# collectives. Both say so in one line and raise the error as it is; the optimizer update never ran.

class MicroBatchRetry:
    """``trainer.training_step`` (one micro-batch's forward and backward) that, on an out-of-memory error in the
    first micro-batch of a step, re-plans for the budget and retries it, at most `MAX_REPLANS` times in a run
    (NOTE [ Which out-of-memory errors the Trainer retries ], above). `install` puts it on the Trainer."""

    def __init__(self, trainer: Any, model: nn.Module, adapter: PlanAdapter) -> None:
        self.trainer = trainer
        self.model = model
        self.adapter = adapter
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.replans = 0
        self._original = trainer.training_step

    def install(self) -> None:
        retry = self

        def training_step(trainer: Any, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> Any:
            return retry.run(model, inputs, num_items_in_batch)

        self.trainer.training_step = types.MethodType(training_step, self.trainer)

    def run(self, model: nn.Module, inputs: Any, num_items_in_batch: Any) -> torch.Tensor:
        """The Trainer's own ``training_step``, retried after a re-plan while its error may be (NOTE above)."""
        while True:
            fresh = all(p.grad is None for p in self.params)
            rng = capture_rng_state()
            try:
                return self._original(model, inputs, num_items_in_batch)  # type: ignore[no-any-return]
            except OUT_OF_MEMORY as err:
                message = str(err).splitlines()[0] if str(err) else type(err).__name__
                step = self.trainer.state.global_step + 1
                self._refuse_retry(step, fresh)
            # Outside the except block: the failed attempt's frames (and the tensors they hold) are released.
            for p in self.params:
                p.grad = None
            release_memory()
            optimizer = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)  # accelerate wraps it
            replan = self.adapter.replan(Overshoot(step=step, budget_bytes=self.adapter.budget_bytes, error=message,
                                                   first_update=not optimizer.state))
            swap_checkpointing(self.model, replan.policy)
            restore_rng_state(rng)
            self.replans += 1
            logger.warning("remat: out of memory in step %d (%s): re-planned %s -> %s; retrying the micro-batch "
                           "(re-plan %d/%d)", step, message, replan.old, replan.new, self.replans, MAX_REPLANS)

    def _refuse_retry(self, step: int, fresh: bool) -> None:
        """Re-raise the error being handled, said in one line, when this micro-batch may not be retried."""
        world_size = self.trainer.args.world_size
        why = ("a later micro-batch of the step (the earlier ones' gradients are accumulated)" if not fresh
               else f"one of {world_size} processes (its peers wait in the step's collectives)" if world_size > 1
               else f"{MAX_REPLANS} re-plans were made already" if self.replans >= MAX_REPLANS else None)
        if why is not None:
            logger.error("remat: out of memory in step %d under %s: not retried: %s; a smaller memory_budget, "
                         "per_device_train_batch_size or loss='fused' would help", step, self.adapter.describe(), why)
            raise  # noqa: PLE0704 (called from the except block: the out-of-memory error itself)


#: How far the first step's measured peak may exceed the plan's prediction before `FirstStepCheck` re-plans.
FIRST_STEP_TOLERANCE = 0.05


class FirstStepCheck:
    """The plan of ``auto`` held against the measured peak of the first step the prediction is of (`remat.integrations.hf_trainer.RematCallback`
    runs it once).

    # NOTE [ The plan is checked against the first step ]
    # The planner predicts the step it can model; a trainer may run another (a loss path of its own, a collator's
    # shapes, hooks that hold tensors), and on a GPU that is an out-of-memory error on a budget remat said fits.
    # The first step whose optimizer already holds its state (step 2 under AdamW, whose state the first update
    # creates after that step's peak; step 1 under a stateless optimizer) is the step the prediction is of: its
    # measured peak (the CUDA allocator's, or the exact tracked peak on the CPU) is compared with the prediction.
    # More than FIRST_STEP_TOLERANCE over it, or over the budget, re-plans before the next step, as the
    # out-of-memory path does, with the measured excess taken off the planning budget (the
    # memory the planner cannot see is taken to be there in every step); where no plan fits that, or several
    # processes run (each would re-plan alone), one WARNING line says by how much and why, and the plan stays.
    """

    def __init__(self, model: nn.Module, adapter: PlanAdapter) -> None:
        self.model = model
        self.adapter = adapter
        self.done = False

    def __call__(self, step: int, measured: int, world_size: int) -> None:
        self.done = True
        estimate = self.adapter.planner.estimate(self.adapter.policy)
        predicted, budget = estimate.peak_bytes, self.adapter.budget_bytes
        excess = measured - predicted
        if measured <= predicted * (1 + FIRST_STEP_TOLERANCE) and measured <= budget:
            logger.info("remat: step %d peaked at %s, predicted %s (budget %s)", step, size(measured),
                        size(predicted), size(budget))
            return
        said = (f"remat: step {step} peaked at {size(measured)}, {size(excess)} ({excess / predicted:+.0%}) over the "
                f"predicted {size(predicted)} under {self.adapter.policy.describe()} (budget {size(budget)}): the "
                "trainer's step holds memory the planner does not model")
        if world_size > 1:
            logger.warning("%s; not re-planned: one of %d processes would change its plan alone", said, world_size)
            return
        overshoot = Overshoot(step=step, budget_bytes=budget, peak_bytes=forward_backward_peak(estimate) + excess)
        try:
            with leaving_no_trace(self.model):
                replan = self.adapter.replan(overshoot)
        except ConfigError as err:
            logger.warning("%s; not re-planned: %s", said, str(err).splitlines()[0])
            return
        swap_checkpointing(self.model, replan.policy)
        logger.warning("%s; re-planned %s -> %s before step %d", said, replan.old, replan.new, step + 1)


