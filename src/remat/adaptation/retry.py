"""Run-time adaptation of ``activation_checkpointing: auto``: watch each step against the memory budget, and when a
step goes over it (or raises an out-of-memory error) re-plan, swap the checkpointing in place and retry that step.

The recipe sits below the planner, so the planning itself comes in as a `Replanner` (`remat.adaptation` makes
one; `remat finetune` passes it to `FinetuneRecipe`). What happens here:

- **Watched**: the peak of the step's forward and backward passes (every micro-batch), read from the step's memory
  meter (CUDA allocator, or the exact tensor tracker on the CPU) just before the optimizer update, and agreed over
  the ranks (the maximum). Checkpointing changes only that part of the step: the optimizer update's own memory
  (parameters, gradients, optimizer state) is the same under every plan.
- **Over budget** (or `torch.OutOfMemoryError` before the optimizer update, single process): the update is not
  applied (the step raises `StepOverBudget` before it), gradients are dropped, caches emptied on CUDA; the
  replanner gives a new policy; `DistributedSetup.replace_checkpointing` swaps it in; the RNG states are put back
  and the step runs again on the same micro-batches. The optimizer state, the learning-rate schedule and the data
  position were never advanced by the failed attempt. One log line says the old and new plans and why.
- **Bounded**: at most ``activation_checkpointing.max_replans`` re-plans in a run, then `MemoryBudgetError` saying what the last
  plan needed and what would help.
- **Relaxed** (`remat.adaptation.relax_watch`): after ``activation_checkpointing.relax_after_steps`` steps well under the budget, a plan
  with less recompute may be swapped in after a step; if it then goes over, the step is retried as above and
  relaxing stops.

- **Out of memory on one of several ranks**: its peers already wait in the step's collectives, so the step cannot
  be retried in place. The rank writes an out-of-memory note (`remat.adaptation.oom_notes`) and fails;
  torchrun restarts the workers (``--max-restarts``), the run resumes from its newest checkpoint and re-plans from
  the note before its first step (`StepRetry.replan_after_restart`), counted like any re-plan.

An out-of-memory error in the optimizer update itself is not retried: it is raised as it is.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from remat.checkpointing import CheckpointPolicy, apply_activation_checkpointing, remove_activation_checkpointing
from remat.checkpointing.plan import planned_policy
from remat.distributed import DistributedSetup
from remat.errors import MemoryBudgetError, RematError
from remat.memory import MemoryReading, StepMemoryMeter, max_over_ranks
from remat.adaptation.oom_notes import (OutOfMemoryNote, clear_notes, pending_note, restart_generation,
                                        restarts_left, write_note)
from remat.adaptation.relax_watch import RelaxWatch, Stretch
from remat.distributed.config import AutoCheckpointing
from remat.recipes.run_safety.run_lock import on_rank0
from remat.recipes.step import UPDATE_PHASE
from remat.training_state.layout import capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from remat.adaptation.adapter import PlanAdapter
    from remat.recipes.finetune import FinetuneRecipe

logger = logging.getLogger(__name__)

GIB: Final[int] = 2**30
OUT_OF_MEMORY: Final[tuple[type[BaseException], ...]] = (
    getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)
"""What counts as an out-of-memory error (``torch.OutOfMemoryError``; tests raise it on the CPU)."""

T = TypeVar("T")


def size(nbytes: int) -> str:
    """Bytes for the log: ``12.34 GiB``, or ``5.12 MiB`` below 1 GiB (small models on the CPU)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.2f} MiB"


class StepOverBudget(Exception):
    """Raised inside a step, before the optimizer update, when its forward+backward peak (the maximum over the
    ranks) exceeds the budget; the recipe catches it and retries the step."""

    def __init__(self, peak_bytes: int, budget_bytes: int) -> None:
        super().__init__(f"peak {size(peak_bytes)} over the budget {size(budget_bytes)}")
        self.peak_bytes = peak_bytes


@dataclass(frozen=True)
class Overshoot:
    """Why a step is retried: its measured forward+backward ``peak_bytes`` (max over ranks) over ``budget_bytes``,
    or (``peak_bytes`` None) an out-of-memory ``error`` (on ``rank``, when one of several ran out). ``step`` is the
    step's number (1 = the first); ``first_update``: the optimizer had no state yet (its first update: the peak held
    no optimizer state)."""

    step: int
    budget_bytes: int
    peak_bytes: int | None = None
    error: str | None = None
    first_update: bool = False
    rank: int | None = None

    @property
    def reason(self) -> str:
        """In words, for the log line and errors."""
        if self.peak_bytes is not None:
            return f"the step's peak {size(self.peak_bytes)} exceeded the budget {size(self.budget_bytes)}"
        where = f" on rank {self.rank}" if self.rank is not None else ""
        return f"out of memory{where} ({self.error or 'no message'})"


@dataclass(frozen=True)
class Replan:
    """A replanner's answer: the ``policy`` to apply, and the old and new plans in words."""

    policy: CheckpointPolicy
    old: str
    new: str


def release_memory() -> None:
    """After a failed attempt whose gradients were dropped: collect what is unreachable and empty CUDA's cache."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def swap_checkpointing(model: nn.Module, policy: CheckpointPolicy) -> None:
    """Replace ``model``'s checkpointing with ``policy`` (a plan: its notes were said when it was planned), where no
    `DistributedSetup` holds it (a Trainer's model; the recipe's loop uses `DistributedSetup.replace_checkpointing`)."""
    remove_activation_checkpointing(model)
    with planned_policy():
        apply_activation_checkpointing(model, policy)


def _first_line(err: BaseException) -> str | None:
    return str(err).splitlines()[0] if str(err) else None


class StepRetry:
    """Runs a training step under the watch: `attempt` retries a step until it fits or the bound is reached.

    ``log`` receives the one line per re-plan or relax (`FinetuneRecipe` points it at its reporter); ``replans``
    counts the re-plans of this run (kept across resumes through `state_dict`). ``relax_after_steps``: the stable
    stretch after which a plan may be relaxed (`remat.adaptation.relax_watch`; None: never). ``notes_dir``: where a rank of
    several that runs out of memory leaves its note for the restarted run (the checkpoint directory; None: none).
    """

    def __init__(self, replanner: PlanAdapter, *, max_replans: int, setup: DistributedSetup, model: nn.Module,
                 meter: StepMemoryMeter, optimizer: torch.optim.Optimizer,
                 relax_after_steps: int | None = None, notes_dir: Path | None = None) -> None:
        self.replanner = replanner
        self.max_replans = max_replans
        self.setup = setup
        self.model = model
        self.meter = meter
        self.optimizer = optimizer
        self.log: Callable[[str], None] = logger.info
        self.replans = 0
        self.relax = RelaxWatch(relax_after_steps, self._relax)
        self.notes_dir = notes_dir
        self._phase: str | None = None
        self._peak: int | None = None

    @classmethod
    def for_recipe(cls, replanner: PlanAdapter, recipe: FinetuneRecipe) -> StepRetry:
        """The watch of ``recipe``'s run (built, not yet trained): its budget and bounds from its ``auto`` section
        (the defaults for a pinned recipe given a replanner in Python), its notes in its checkpoint directory."""
        auto = recipe.cfg.distributed.auto or AutoCheckpointing()
        return cls(replanner, max_replans=auto.max_replans, setup=recipe.dist, model=recipe.model,
                   meter=recipe.memory_meter, optimizer=recipe.optimizer, relax_after_steps=auto.relax_after_steps,
                   notes_dir=recipe.checkpoint_dir)

    @property
    def budget_bytes(self) -> int:
        """The budget each step is held to."""
        return self.replanner.budget_bytes

    def mark(self, label: str) -> None:
        """`train_step`'s phase marks: passed on to the meter; before the update the watch decides."""
        self._phase = label
        self.meter.mark(label)
        if label != UPDATE_PHASE:
            return
        local = MemoryReading(peak_bytes=self.meter.peak_so_far(), source=self.meter.source)
        peak = max_over_ranks(local).peak_bytes if self.setup.is_distributed else local.peak_bytes
        self._peak = peak
        if peak > self.budget_bytes:
            raise StepOverBudget(peak, self.budget_bytes)

    def attempt(self, step: int, run_step: Callable[[], T]) -> T:
        """``run_step()`` (one training step, calling `mark`), retried after a re-plan while it goes over the
        budget or runs out of memory before its update; ``step`` is its number, for the log."""
        rng = capture_rng_state()
        first_update = not self.optimizer.state
        while True:
            self._phase, self._peak = None, None
            try:
                outcome = run_step()
                self.relax.after_step(step, self._peak, self.budget_bytes, first_update=first_update)
                return outcome
            except StepOverBudget as over:
                overshoot = Overshoot(step, self.budget_bytes, peak_bytes=over.peak_bytes, first_update=first_update)
            except OUT_OF_MEMORY as err:
                if self._phase == UPDATE_PHASE:
                    raise  # the update may be half applied
                if self.setup.is_distributed:  # the other ranks wait in a collective: re-planned after a restart
                    self._leave_note(step, err, first_update)
                    raise
                overshoot = Overshoot(step, self.budget_bytes, error=_first_line(err), first_update=first_update)
            self._free()
            self._replan(overshoot)
            restore_rng_state(rng)

    def _leave_note(self, step: int, err: BaseException, first_update: bool) -> None:
        """One rank of several ran out of memory before its update: write what the restarted run re-plans from, and
        say so on the error and in the log (every rank's log: the others may not know why the run ended)."""
        if self.notes_dir is None:
            return
        note = OutOfMemoryNote(step=step, rank=self.setup.rank, error=_first_line(err) or "no message",
                               first_update=first_update, replans=self.replans, budget_bytes=self.budget_bytes,
                               planner=self.replanner.state_dict(),
                               relax=self.relax.state_dict(), generation=restart_generation())
        try:
            path = write_note(self.notes_dir, note)
        except OSError as write_err:
            logger.error("rank %d ran out of memory at step %d and could not write its re-plan note into %s: %s",
                         note.rank, step, self.notes_dir, write_err)
            return
        left = restarts_left()
        then = (f"torchrun restarts the workers ({left} restart(s) left): they resume from the newest checkpoint and "
                f"re-plan from it before step {step}" if left else
                "no restart is left (torchrun --max-restarts): run the same command again to resume from the newest "
                "checkpoint and re-plan from it")
        message = (f"rank {note.rank} ran out of memory at step {step} before its update; its peers wait in the "
                   f"step's collectives, so the step cannot be retried in place. Wrote {path}: {then}")
        logger.error(message)
        err.add_note(f"remat: {message}")

    def before_first_step(self, resumed_step: int) -> None:
        """An ``auto`` run restarted after one of several ranks ran out of memory re-plans, before its first step,
        from the newest pending out-of-memory note (`remat.adaptation.oom_notes`; read by rank 0, the same on every
        rank)."""
        if self.notes_dir is None:
            return
        directory = self.notes_dir
        note = on_rank0(lambda: pending_note(directory, resumed_step), rank=self.setup.rank,
                        distributed=self.setup.is_distributed)
        self.replan_after_restart(note, resumed_step)

    def finished(self) -> None:
        """The run reached ``max_steps``: nothing is left to re-plan, its notes are removed (by rank 0)."""
        if self.notes_dir is not None and self.setup.is_main_process:
            clear_notes(self.notes_dir)

    def replan_after_restart(self, note: OutOfMemoryNote | None, resumed_step: int) -> None:
        """Before the first step of a restarted run (every rank, with the same ``note``: the newest pending one, read
        by rank 0): take the re-planning state the failed run had and re-plan from its out-of-memory error, as a
        single process would have; the run then continues from ``resumed_step``. A note of another budget is
        ignored (this run plans for its own)."""
        if note is None:
            return
        if note.budget_bytes != self.budget_bytes:
            self.log(f"re-plan: ignored the out-of-memory note of step {note.step} (rank {note.rank}): it was planned "
                     f"for another budget; this run keeps its plan for {size(self.budget_bytes)}")
            return
        self.replans = note.replans
        self.relax.load_state_dict(note.relax)
        policy = self.replanner.load_state_dict(note.planner)
        if policy is not None:  # the plan that failed (re-planned or relaxed after the checkpoint resumed from)
            self.setup.replace_checkpointing(self.model, policy)
        overshoot = Overshoot(note.step, self.budget_bytes, error=note.error, first_update=note.first_update,
                              rank=note.rank)
        rng = capture_rng_state()  # planning in this process may draw random numbers: the run's stay as they were
        self._replan(overshoot, then=f"the workers were restarted: resuming after step {resumed_step}")
        restore_rng_state(rng)

    def _free(self) -> None:
        """Drop what the failed attempt left: gradients, unreachable activations, CUDA's cached blocks."""
        self.optimizer.zero_grad(set_to_none=True)
        release_memory()

    def _replan(self, overshoot: Overshoot, *, then: str | None = None) -> None:
        if self.replans >= self.max_replans:
            raise self._exhausted(overshoot)
        try:
            replan, failure = self._agreed(lambda: self.replanner.replan(overshoot))
        except RematError as err:  # a single process
            raise MemoryBudgetError(self._failed(overshoot, err)) from err
        if not isinstance(replan, Replan):
            raise MemoryBudgetError(self._failed(overshoot, failure))
        self.setup.replace_checkpointing(self.model, replan.policy)
        self.replans += 1
        stops = "; relaxing stops for this run" if self.relax.after_replan() else ""
        self.log(f"re-plan {self.replans}/{self.max_replans} at step {overshoot.step}: {overshoot.reason}; "
                 f"activation checkpointing {replan.old} -> {replan.new}; {then or f'retrying step {overshoot.step}'}"
                 f"{stops}")

    def _relax(self, stretch: Stretch) -> bool:
        """Ask for a relaxed plan (every rank together, after ``stretch``); swap it in and say so. True when
        swapped."""
        rng = capture_rng_state()  # planning in this process may draw random numbers: the run's stay as they were
        answer, failure = self._agreed(lambda: self.replanner.relax(stretch))
        restore_rng_state(rng)
        if answer is None:
            raise RematError(f"relaxing the plan after step {stretch.step}: {failure}")
        measured = (f"the last {stretch.steps} steps peaked at {size(stretch.peak_bytes)}, "
                    f"{100 * stretch.peak_bytes / stretch.budget_bytes:.0f}% of the budget "
                    f"{size(stretch.budget_bytes)}")
        if not isinstance(answer, Replan):
            self.log(f"relax: kept the plan at step {stretch.step} ({measured}): {answer}")
            return False
        self.setup.replace_checkpointing(self.model, answer.policy)
        self.log(f"relax {self.relax.relaxes + 1} at step {stretch.step}: {measured}; activation checkpointing "
                 f"{answer.old} -> {answer.new}; from step {stretch.step + 1}")
        return True

    def _agreed(self, ask: Callable[[], T]) -> tuple[T | None, str | None]:
        """``ask()`` answered once for every rank: in a single process its answer (its errors raised); with several,
        rank 0's, broadcast with the replanner's state (which the other ranks take over), and rank 0's error as
        ``(None, message)`` on every rank (the other ranks must not wait for rank 0 forever)."""
        if not self.setup.is_distributed:
            return ask(), None
        failure: str | None = None
        answer: T | None = None
        if self.setup.rank == 0:
            try:
                answer = ask()
            except RematError as err:
                failure = str(err)
            except Exception as err:  # a bug
                failure = f"{type(err).__name__} on rank 0: {err}"
        payload: list[Any] = [(answer, self.replanner.state_dict() if answer is not None else None, failure)]
        dist.broadcast_object_list(payload, src=0)
        answer, state, failure = payload[0]
        if answer is not None and self.setup.rank != 0:
            self.replanner.load_state_dict(state)
        return answer, failure

    @staticmethod
    def _failed(overshoot: Overshoot, error: object) -> str:
        return f"re-planning at step {overshoot.step} after {overshoot.reason}: {error}"

    def _exhausted(self, overshoot: Overshoot) -> MemoryBudgetError:
        done = (f"after {self.replans} re-plan(s) (activation_checkpointing.max_replans: {self.max_replans})" if self.max_replans
                else "and re-planning is off (activation_checkpointing.max_replans: 0)")
        return MemoryBudgetError(
            f"distributed.activation_checkpointing.memory_budget: step {overshoot.step} does not fit {size(self.budget_bytes)} "
            f"{done}: {overshoot.reason} under the last plan, {self.replanner.describe()}. What would help: a larger "
            "memory_budget if the device has room; a smaller micro-batch "
            "(step_scheduler.local_batch_size); the fused loss (loss_fn._target_: remat.loss.FusedLinearCrossEntropy);"
            " FSDP or more ranks (distributed.strategy: fsdp2); or more re-plans (max_replans)")

    # --- checkpoints -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """For ``train_state.json``: the replans done, the replanner's state (the policy in force) and the relax
        watch's (`remat.adaptation.relax_watch`)."""
        return {"replans": self.replans, "planner": self.replanner.state_dict(), "relax": self.relax.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> str | None:
        """Resume with the saved re-planned policy (applied in place) and count; returns a note for the log, or
        None when the checkpoint's run had not re-planned."""
        self.replans = int(state.get("replans", 0))
        self.relax.load_state_dict(state.get("relax", {}))
        policy = self.replanner.load_state_dict(state.get("planner", {}))
        if policy is None:
            return None
        self.setup.replace_checkpointing(self.model, policy)
        return (f"activation checkpointing: resumed with the plan re-planned at run time ({self.replans} re-plan(s), "
                f"{self.relax.relaxes} relax(es) so far): {self.replanner.describe()}")
