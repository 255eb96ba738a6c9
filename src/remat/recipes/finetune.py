"""The fine-tuning recipe: build everything a recipe names, then train with checkpoints that survive interruption.

``FinetuneRecipe(cfg).run()`` is what ``remat finetune recipe.yaml`` does. The loop per optimizer step: draw the
micro-batches of one global batch, count their label tokens, run forward+backward on each (the loss is normalised by
the step's total label tokens, so accumulation equals one big batch), clip, step, log one line, and maybe validate
and save. SIGTERM/SIGINT/SIGHUP finish the current step, save a checkpoint and stop cleanly.

Under torchrun (``distributed.strategy`` ddp or fsdp2) every rank runs this loop on its own shard of each global
batch: the label-token count that normalises the loss is summed over the data-parallel ranks first, so the loss and
gradients equal those of one process taking the whole global batch; the logged loss is the global mean, ``tps`` the
global throughput and ``mem`` the maximum over ranks; only rank 0 prints and writes metrics. Stop requests are agreed
on by all ranks, and checkpoints are sharded (fsdp2, torch.distributed.checkpoint) or written by rank 0 (ddp).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TypeVar

import torch

from remat._files import disk_full_error, is_disk_full
from remat._logs import quiet_log
from remat.data import IGNORE_INDEX, build_dataset, build_tokenizer
from remat.data.loader import StatefulBatchIterator
from remat.data.fingerprint import dataset_fingerprint
from remat.data.loader import collate
from remat.distributed.env import ProcessEnv
from remat.errors import ConfigError, RematError
from remat.memory import StepMemoryMeter, max_over_ranks
from remat.models import count_parameters
from remat.models.config import with_concrete_dtype
from remat.models.fp8 import after_optimizer_step, check_fp8_device
from remat.models.qat import fake_quant_wanted, set_fake_quant
from remat.recipes.build import build_optimizer, build_recipe_model, build_training_module, distributed_setup
from remat.recipes.config import RecipeConfig
from remat.recipes.lr_schedule import build_lr_scheduler
from remat.recipes.model_loss import count_label_tokens
from remat.recipes.run_safety.numerics import NonFiniteGuard, refuse_to_resume, refuse_to_save, unusual_settings
from remat.recipes.run_safety.output_paths import OutputPaths
from remat.recipes.parallel_layout import check_parallel_layout
from remat.recipes.run_safety.resume_changes import early_refusal, plan_resume
from remat.recipes.run_safety.run_lock import RunLocks, acquire_on_rank0, on_rank0, run_directories
from remat.recipes.reports.run_report import write_run_report
from remat.recipes.reports.reporting import RunReporter, StepRecord
from remat.recipes.step import StepOutcome, autocast, step_label_tokens, train_step
from remat.training_state.stores import state_store, store_for_saved
from remat.training_state.history import check_saved_step, keep_newer_checkpoints
from remat.training_state.layout import remove_stale_work_dirs, step_directories
from remat.training_state.verify import load_newest_verified, load_verified, supersede_checkpoints

StepCallback = Callable[["FinetuneRecipe", StepRecord], None]

MEMORY_SOURCE_NOTES = {
    "cuda": "peak of the CUDA caching allocator (torch.cuda.max_memory_allocated) during the step",
    "tracked": "exact peak of live tensor bytes during the step (parameters, gradients, optimizer state, "
               "activations and temporaries), counted by remat's tensor tracker",
    "rss": "peak resident set size of the process during the step (includes the Python runtime and libraries)",
}


@dataclass
class RunResult:
    """What ``FinetuneRecipe.run`` did: the steps it trained, why it stopped and its last checkpoint."""

    records: list[StepRecord] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)
    start_step: int = 0
    final_step: int = 0
    stopped_early: bool = False
    last_checkpoint: Path | None = None
    stop_signal: int | None = None

    @property
    def exit_code(self) -> int:
        """0 for a run that ended by itself; 128 + the signal's number (130 SIGINT, 143 SIGTERM, 129 SIGHUP) for one a
        signal stopped, as shells and job schedulers expect, even though it saved and stopped cleanly."""
        return 128 + self.stop_signal if self.stop_signal is not None else 0


logger = logging.getLogger(__name__)


_T = TypeVar("_T")


class StepGuard(Protocol):
    """The run-time watch of ``activation_checkpointing: auto`` as the loop sees it (`remat.adaptation`, above the
    recipe, makes one: `remat.adaptation.retry.StepRetry`)."""

    log: Callable[[str], None]
    """Where its one line per re-plan or relax goes (the run's reporter)."""

    def mark(self, label: str) -> None:
        """`train_step`'s phase marks (before the update it holds the step to the budget)."""

    def attempt(self, step: int, run_step: Callable[[], _T]) -> _T:
        """``run_step()``, re-planned and retried while it goes over the budget or out of memory."""

    def before_first_step(self, step: int) -> None:
        """After a restart: re-plan from a pending out-of-memory note, before the first step."""

    def finished(self) -> None:
        """The run reached its last step."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (JSON types)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> str | None:
        """Resume it; a line for the log when the checkpoint's run had re-planned."""


class Adaptation(Protocol):
    """What makes the watch of a run (`remat.adaptation.adapter.PlanAdapter`)."""

    def guard(self, recipe: FinetuneRecipe) -> StepGuard:
        """The watch of ``recipe``'s steps (called once ``recipe`` is built)."""


class FinetuneRecipe:
    """A fine-tuning run built from a validated ``RecipeConfig``."""

    def __init__(self, cfg: RecipeConfig, *, callbacks: list[StepCallback] | None = None,
                 replanner: Adaptation | None = None, source: str | Path | None = None) -> None:
        """``replanner`` (given by `remat finetune` for ``activation_checkpointing: auto``: a
        `remat.adaptation.adapter.PlanAdapter`) turns on the run-time watch: a step over
        ``activation_checkpointing.memory_budget`` is re-planned and retried (`remat.adaptation`)."""
        cfg = cfg.model_copy(update={"model": with_concrete_dtype(cfg.model)})  # `auto`: read once, here
        self.cfg = cfg
        self.source = source
        """The recipe file the run was read from (said at start), when it came from one."""
        self.callbacks: list[StepCallback] = list(callbacks or [])
        self.replanner = replanner
        self._stop_reason: str | None = None
        self._stop_signal: int | None = None
        _, self.grad_accumulation = check_parallel_layout(cfg, ProcessEnv.from_environ().world_size)
        # Every rank, before the process group and anything else: a path that cannot be written is one line.
        OutputPaths.of(cfg.output_dir, cfg.checkpoint.checkpoint_dir, cfg.checkpoint.enabled,
                       cfg.logging.metrics_file).check()
        self.dist = distributed_setup(cfg)
        check_fp8_device(cfg.fp8, self.dist.device)  # before the data is read and the model built
        self.output_dir = Path(cfg.output_dir)
        self.checkpoint_dir = checkpoint_directory(cfg)
        self.nonfinite = NonFiniteGuard.from_config(cfg.training, unusual_settings(cfg))
        self.run_locks: RunLocks | None = None

    # ------------------------------------------------------------------------------------------------ building

    def setup(self) -> None:
        """Build tokenizer, data, model (+LoRA, checkpointing), optimizer, schedule and loss; resume if asked. First
        takes the run's directory locks (`remat.recipes.run_safety.run_lock`; ``run`` or ``release_run_locks`` lets them go)."""
        self._take_run_locks()
        try:
            self._build()
        except RematError:  # refused before training (a changed recipe, a bad checkpoint...): leave no trace
            if self.run_locks is not None:
                self.run_locks.abandon()
            raise

    def _build(self) -> None:
        cfg = self.cfg
        self._refuse_another_run()
        _seed_everything(cfg.seed)
        with self.dist.local_main_first():  # one process per node trains/caches the tokenizer, the others load it
            self.tokenizer = build_tokenizer(cfg.tokenizer, model_path=cfg.model.pretrained_model_name_or_path,
                                             trust_remote_code=cfg.model.trust_remote_code)
            self.train_data = build_dataset(cfg.dataset, self.tokenizer, default_split="train", key_prefix="dataset")
            self.val_data = (
                build_dataset(cfg.validation_dataset, self.tokenizer, default_split="validation",
                              key_prefix="validation_dataset")
                if cfg.validation_dataset is not None else None
            )
        self.cfg = cfg = _steps_of_epochs(cfg, len(self.train_data))
        # `self.model` stays the transformers (or peft) model, for saving; `compute_loss` is what the step calls.
        self.model = build_recipe_model(cfg, vocab_size=len(self.tokenizer), device=str(self.dist.device))
        with quiet_log("remat.checkpointing.apply"):  # the setup report prints the plan's table, once
            self.compute_loss = build_training_module(self.model, cfg, self.dist)
        self.optimizer = build_optimizer(cfg, (p for p in self.model.parameters() if p.requires_grad))
        self.fake_quant_on = True  # the QAT layers start fake-quantising (remat.models.qat)
        self.after_update = functools.partial(after_optimizer_step, self.model, cfg.fp8) if (
            cfg.fp8.enabled and cfg.fp8.precompute_float8_dynamic_scale_for_fsdp) else None
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.step_scheduler.max_steps)
        self.batches = StatefulBatchIterator(
            self.train_data, cfg.step_scheduler.local_batch_size, shuffle=cfg.dataset.shuffle, seed=cfg.seed,
            rank=self.dist.dp_rank, world_size=self.dist.dp_size,
        )
        self.memory_meter = StepMemoryMeter(_memory_source(cfg, self.dist.device), model=self.model,
                                            optimizer=self.optimizer)
        self.retry: StepGuard | None = self.replanner.guard(self) if self.replanner is not None else None
        self.step = 0
        self.data_fingerprint = dataset_fingerprint(self.train_data)
        self.resume_notes: list[str] = []
        self.resumed_from = self._maybe_resume()

    def _refuse_another_run(self) -> None:
        """A checkpoint directory whose every checkpoint belongs to another run (another model, tokenizer, seed...),
        refused from the recipes alone, before the data is tokenized and the model built; agreed between ranks."""
        ckpt = self.cfg.checkpoint
        if not ckpt.enabled or ckpt.resume in ("restart", "never"):
            return
        candidates = step_directories(self.checkpoint_dir) if ckpt.resume == "auto" else [Path(ckpt.resume)]
        refusal = early_refusal([path for path in candidates if path.is_dir()], self.cfg)
        if self.dist.any_rank(refusal is not None):
            raise refusal or ConfigError(f"cannot resume from {self.checkpoint_dir} with this recipe: another rank "
                                         "found its checkpoints belong to another run (see that rank's error)")

    def _maybe_resume(self) -> Path | None:
        """Choose, verify and load the checkpoint to continue from (`remat.training_state.verify`): with
        ``auto`` the newest that verifies and loads, each one skipped said; None when starting at step 0."""
        ckpt = self.cfg.checkpoint
        if not ckpt.enabled:
            return None
        if ckpt.resume == "restart":
            supersede_checkpoints(self.checkpoint_dir)
            return None
        if ckpt.resume == "never":
            existing = step_directories(self.checkpoint_dir)
            if existing:
                raise ConfigError(
                    f"checkpoint.resume: 'never' but {self.checkpoint_dir} already holds checkpoints (newest: "
                    f"{existing[-1].name}); refusing to overwrite them. Use checkpoint.resume: auto to continue, "
                    "restart (--restart) to move them aside and start over, or another checkpoint.checkpoint_dir / "
                    "output_dir"
                )
            return None
        if ckpt.resume == "auto":
            chosen = load_newest_verified(self.checkpoint_dir, self._restore)
            return chosen[0] if chosen is not None else None
        path = Path(ckpt.resume)
        if not path.is_dir():
            raise ConfigError(f"checkpoint.resume: {ckpt.resume!r} is not a checkpoint directory; "
                              "allowed: auto, never, restart, or the path of a step_N checkpoint")
        self._keep_newer_checkpoints(path)  # a named older step: never re-train over newer ones silently
        load_verified(path, self._restore)
        return path

    def _restore(self, path: Path) -> None:
        """Load the verified checkpoint at ``path`` into the run (model, optimizer, schedule, RNGs, data position),
        after classifying how the recipe changed since it was saved (`remat.recipes.run_safety.resume_changes`): a refused
        change is a ConfigError before anything is loaded; applied and compatible ones are applied here."""
        changes = plan_resume(path, self.cfg, data_fingerprint=self.data_fingerprint, batches=self.batches,
                              optimizer=self.optimizer)
        state = self._load(path)
        self.step = check_saved_step(path, state["step"])
        self.batches.load_state_dict(changes.data_state(state["data"], self.batches))
        self.resume_notes = changes.apply(self.optimizer, self.lr_scheduler, self.step)
        if self.retry is not None and "replan" in state:
            note = self.retry.load_state_dict(state["replan"])
            self.resume_notes += [note] if note is not None else []

    # ------------------------------------------------------------------------------------------------ training

    def run(self) -> RunResult:
        """Set up (if not done) and train until ``max_steps`` or a stop request; returns what happened. The run holds
        its output_dir (and checkpoint_dir) lock from setup to its end."""
        try:
            return self._run_holding_lock()
        finally:
            self.release_run_locks()

    def _run_holding_lock(self) -> RunResult:
        if not hasattr(self, "model"):
            self.setup()
        cfg = self.cfg
        max_steps = cfg.step_scheduler.max_steps
        result = RunResult(start_step=self.step, final_step=self.step)
        reporter = RunReporter(cfg.logging, self.output_dir, total_steps=max_steps, start_step=self.step,
                               enabled=self.dist.is_main_process, recipe=cfg.model_dump(mode="json", by_alias=True),
                               attempt=self.attempt)
        with reporter, _stop_on_signals(self._on_signal):
            self._report_setup(reporter)
            if self.retry is not None:
                self.retry.log = reporter.info
                self.retry.before_first_step(self.step)
            if self.step >= max_steps:
                reporter.info(f"nothing to do: {self.resumed_from} is already at step {self.step} >= max_steps "
                              f"{max_steps}; raise step_scheduler.max_steps or use a new output_dir to train more")
                return result
            self.model.train()
            while self.step < max_steps and not self._stop_agreed():
                record = self._train_step()
                result.records.append(record)
                reporter.step(record)
                skipped = self.nonfinite.after_step(record, result.last_checkpoint or self.resumed_from)
                if skipped is not None:
                    reporter.info(skipped)
                for callback in self.callbacks:
                    callback(self, record)
                sched = cfg.step_scheduler
                if self.val_data is not None and sched.val_every_steps and self.step % sched.val_every_steps == 0:
                    val_loss, val_tokens = self.validate()
                    result.validation.append((self.step, val_loss))
                    reporter.validation(self.step, val_loss, val_tokens)
                if sched.ckpt_every_steps and self.step % sched.ckpt_every_steps == 0 and self.step < max_steps:
                    result.last_checkpoint = self._save(reporter)
            result.final_step = self.step
            if self.retry is not None and self.step >= max_steps:
                self.retry.finished()  # nothing is left to re-plan
            result.stopped_early = self._stop_reason is not None and self.step < max_steps
            result.stop_signal = self._stop_signal
            if result.stopped_early:
                reporter.info(f"stopping at step {self.step}: {self._stop_reason}")
            if cfg.checkpoint.enabled and (cfg.checkpoint.save_final or result.stopped_early):
                if result.last_checkpoint is None or not result.last_checkpoint.name.endswith(f"_{self.step}"):
                    result.last_checkpoint = self._save(reporter)
        if self.dist.is_main_process and cfg.logging.metrics_file and result.records:
            self._report_run(result)
        return result

    def _report_run(self, result: RunResult) -> None:
        """Print the run's summary and draw ``report.png`` beside its metrics (the whole run, resumes included)."""
        model_dir = result.last_checkpoint / "model" if result.last_checkpoint is not None else None
        summary, png = write_run_report(self.output_dir, metrics_file=self.cfg.logging.metrics_file or "",
                                        model_dir=model_dir if model_dir is not None and model_dir.is_dir() else None)
        print("\n".join(["", *summary.lines(), f"report: {png}"]), flush=True)

    # ------------------------------------------------------------------------------------------------ one writer

    @property
    def attempt(self) -> int:
        """This run's attempt number in its output_dir (1 for the first run there), as its metrics rows record."""
        return self.run_locks.attempt if self.run_locks is not None else 1

    def _take_run_locks(self) -> None:
        """Lock output_dir and checkpoint_dir for this run (ConfigError on every rank naming the holder when another
        run has one), say so when a dead run's lock is taken over, and clear leftovers of interrupted saves."""
        if self.run_locks is not None:
            return
        self.run_locks = acquire_on_rank0(run_directories(self.cfg), rank=self.dist.rank,
                                          distributed=self.dist.is_distributed)
        if self.dist.is_main_process:
            for note in self.run_locks.notes:
                print(note, flush=True)
            if self.checkpoint_dir.is_dir():
                remove_stale_work_dirs(self.checkpoint_dir)

    def release_run_locks(self) -> None:
        """Let go of this run's directory locks (``run`` does it when it ends)."""
        if self.run_locks is not None:
            self.run_locks.release()

    def _keep_newer_checkpoints(self, resumed: Path) -> None:
        """Never train over checkpoints newer than ``resumed`` silently: ``checkpoint.on_newer_checkpoints``."""
        note = on_rank0(lambda: keep_newer_checkpoints(self.checkpoint_dir, resumed, attempt=self.attempt,
                                                       policy=self.cfg.checkpoint.on_newer_checkpoints),
                        rank=self.dist.rank, distributed=self.dist.is_distributed)
        if note is not None and self.dist.is_main_process:
            print(note, flush=True)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        self._stop_signal = signum
        self.request_stop(f"received {name}")
        if self.dist.is_main_process:
            again = "Ctrl-C" if signum == signal.SIGINT else name
            print(f"received {name}: stopping after the current step and saving a checkpoint; {again} again stops "
                  "at once (the last complete checkpoint stays)", file=sys.stderr, flush=True)

    def request_stop(self, reason: str = "stop requested") -> None:
        """Finish the current step, save a checkpoint and return from ``run`` (used by signal handlers)."""
        self._stop_reason = reason

    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop; all ranks then stop after the same step (and save together).

        The answer is the collective's, never a second read of ``_stop_reason``: a signal handled between the two
        would make this rank stop while its peers, told "no" by the same collective, train on (the two then wait in
        different collectives until torchrun kills them)."""
        agreed = self.dist.any_rank(self._stop_reason is not None)
        if agreed and self._stop_reason is None:
            self._stop_reason = "stop requested on another rank"
        return agreed

    def _train_step(self) -> StepRecord:
        start = time.perf_counter()
        if self.cfg.qat.enabled and fake_quant_wanted(self.cfg.qat, self.step + 1) != self.fake_quant_on:
            self.fake_quant_on = not self.fake_quant_on  # switched when it changes (twice a run at most), not per step
            set_fake_quant(self.model, self.cfg.qat, self.fake_quant_on)
        micro_batches = [self._to_device(next(self.batches)) for _ in range(self.grad_accumulation)]
        label_tokens = step_label_tokens(micro_batches, self.dist)
        retry = self.retry

        def attempt() -> StepOutcome:
            with self.memory_meter.step():
                return train_step(self.compute_loss, list(self.model.parameters()), self.optimizer, micro_batches,
                                  setup=self.dist, label_tokens=label_tokens, autocast_dtype=self.cfg.model.autocast,
                                  max_norm=self.cfg.clip_grad_norm.max_norm, lr_scheduler=self.lr_scheduler,
                                  after_update=self.after_update,
                                  **({"mark": retry.mark} if retry is not None else {}))

        outcome = retry.attempt(self.step + 1, attempt) if retry is not None else attempt()
        self.step += 1
        global_loss = self.dist.sum_over_shards([float(outcome.loss)])[0]
        reading = max_over_ranks(self.memory_meter.last)
        elapsed = time.perf_counter() - start
        tokens = sum(b["input_ids"].numel() for b in micro_batches) * self.dist.dp_size
        return StepRecord(
            step=self.step, epoch=self.batches.epoch, loss=global_loss, grad_norm=float(outcome.grad_norm),
            lr=outcome.lr, mem_bytes=reading.peak_bytes, mem_source=reading.source, tps=tokens / elapsed,
            num_label_tokens=label_tokens, step_time_s=elapsed, skipped=bool(outcome.skipped),
        )

    @torch.no_grad()
    def validate(self) -> tuple[float, int]:
        """Mean loss per label token over the validation set (capped at ``step_scheduler.val_batches`` global
        batches), each data-parallel rank evaluating its share of every batch; sums are taken over ranks."""
        assert self.val_data is not None
        self.model.eval()
        total, tokens = 0.0, 0
        for batch in sharded_eval_batches(self.val_data, self.cfg.step_scheduler.local_batch_size,
                                          rank=self.dist.dp_rank, world_size=self.dist.dp_size,
                                          max_batches=self.cfg.step_scheduler.val_batches):
            batch = self._to_device(batch)
            with autocast(self.cfg.model.autocast, self.dist.device.type):
                # num_label_tokens=1 turns the mean into a sum, so batches of different sizes weigh correctly.
                total += float(self.compute_loss(batch, num_label_tokens=1))
            tokens += count_label_tokens(batch["labels"])
        self.dist.reshard()
        self.model.train()
        total = self.dist.sum_over_shards([total])[0]  # each context-parallel rank holds its shard's loss
        global_tokens = self.dist.sum_over_dp([float(tokens)])[0]
        return total / max(global_tokens, 1.0), int(global_tokens)

    # ------------------------------------------------------------------------------------------------ helpers

    def _save(self, reporter: RunReporter) -> Path:
        """Save on every rank together: sharded for fsdp2, from rank 0 in the single-process format otherwise."""
        train_state = {"step": self.step, "epoch": self.batches.epoch, "data": self.batches.state_dict(),
                       "config": self.cfg.model_dump(mode="json", by_alias=True),
                       "data_fingerprint": self.data_fingerprint}
        if self.retry is not None:
            train_state["replan"] = self.retry.state_dict()
        arguments: dict[str, Any] = {
            "model": self.model, "optimizer": self.optimizer, "lr_scheduler": self.lr_scheduler,
            "train_state": train_state, "tokenizer": self.tokenizer, "keep_last": self.cfg.checkpoint.keep_last,
        }
        refuse_to_save(self.step, self.model, self.optimizer, self.dist, self.checkpoint_dir)
        try:
            path = state_store(self.dist).save(self.checkpoint_dir, self.step, **arguments)
        except BaseException as err:  # torch.distributed.checkpoint's CheckpointException is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)) or not is_disk_full(err):
                raise
            raise disk_full_error(err, self.checkpoint_dir, _checkpoint_bytes(self.model, self.optimizer)) from None
        reporter.info(f"saved checkpoint {path}")
        return path

    def _load(self, path: Path) -> dict[str, Any]:
        states = {"model": self.model, "optimizer": self.optimizer, "lr_scheduler": self.lr_scheduler}
        state = store_for_saved(path, self.dist).load(path, **states, verify=False)  # verified by the caller
        refuse_to_resume(path, self.model, self.optimizer, self.dist)
        return state

    def _report_setup(self, reporter: RunReporter) -> None:
        total, trainable = count_parameters(self.model), sum(
            p.numel() for p in self.model.parameters() if p.requires_grad)
        cfg = self.cfg
        if self.source is not None:
            reporter.info(f"recipe: {self.source}")
        reporter.info(f"model: {type(self.model).__name__}, {total / 1e6:.2f}M parameters "
                      f"({trainable / 1e6:.2f}M trainable), dtype {cfg.model.dtype}"
                      + (f", autocast {cfg.model.autocast}" if cfg.model.autocast else ""))
        reporter.info(f"distributed: {self.dist.describe()}")
        reporter.info(f"data: {len(self.train_data)} rows of {cfg.dataset.seq_length} tokens; global batch "
                      f"{cfg.step_scheduler.global_batch_size} = local {cfg.step_scheduler.local_batch_size} x dp "
                      f"{self.dist.dp_size} x accumulation {self.grad_accumulation}"
                      + (f"; each row cut over cp {self.dist.cp_size} ranks ({-(-cfg.dataset.seq_length // self.dist.cp_size)} "
                         "tokens each)" if self.dist.cp_size > 1 else ""))
        plan = self.dist.plan
        has_plan = plan is not None and len(plan) > 0
        reporter.info("activation checkpointing: " + (plan.table() if has_plan else "off"))
        ranks = (f"; the maximum over the {self.dist.world_size} ranks" if self.dist.world_size > 1 else "")
        reporter.info(f"mem: {MEMORY_SOURCE_NOTES[self.memory_meter.source]}{ranks}")
        if self.resumed_from is not None:
            reporter.info(f"resumed from {self.resumed_from} at step {self.step}")
            for note in self.resume_notes:
                reporter.info(note)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.dist.device, non_blocking=True) for k, v in batch.items()}


def _checkpoint_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """About what one checkpoint takes on this rank's disk: the parameters twice (training state and the exported
    model) and the optimizer state."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return 2 * params + state


def checkpoint_directory(cfg: RecipeConfig) -> Path:
    """Where the recipe's checkpoints go: ``checkpoint.checkpoint_dir``, by default ``output_dir/checkpoints``."""
    return Path(cfg.checkpoint.checkpoint_dir or Path(cfg.output_dir) / "checkpoints")


def sharded_eval_batches(
    dataset: torch.utils.data.Dataset[dict[str, torch.Tensor]],
    batch_size: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    max_batches: int | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's share of each evaluation batch, in order, without shuffling.

    A global batch is ``batch_size x world_size`` consecutive rows and rank r takes the r-th slice. Every rank gets
    the same number of batches, so collectives stay in step: a rank whose slice of the last batch is empty gets a
    copy of row 0 whose labels are all ignored (no loss, no label tokens).
    """
    num_rows = len(dataset)  # type: ignore[arg-type]
    global_batch = batch_size * world_size
    num_batches = -(-num_rows // global_batch)
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    for index in range(num_batches):
        start = index * global_batch + rank * batch_size
        rows = [dataset[i] for i in range(start, min(start + batch_size, num_rows))]
        if not rows and num_rows:
            rows = [_ignored(dataset[0])]
        yield collate(rows)


def _ignored(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {**row, "labels": torch.full_like(row["labels"], IGNORE_INDEX)}


def _memory_source(cfg: RecipeConfig, device: torch.device) -> str:
    """``logging.memory``, except that ``auto`` on the CPU with ``compile`` reads the process's peak RSS: the exact
    tracker sees every op through a dispatch mode, under which torch.compile would run the blocks eagerly."""
    if cfg.compile.enabled and cfg.logging.memory == "auto" and device.type != "cuda":
        return "rss"
    return cfg.logging.memory


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed % 2**32)


#: The signals that stop a run after its current step, with a checkpoint (SIGHUP where the platform has one).
STOP_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT,
                                 *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))


@contextlib.contextmanager
def _stop_on_signals(on_signal: Callable[[int], None]) -> Iterator[None]:
    """On the first SIGTERM/SIGINT/SIGHUP call ``on_signal`` (the loop stops after the current step); a second one
    stops at once: SIGINT raises KeyboardInterrupt, SIGTERM and SIGHUP take their default action. SIGHUP (a closed
    terminal, some job managers) is a request to stop like SIGTERM, not a reason to lose the steps since the last save. Checkpoints are written to a temporary
    directory and renamed when complete, so stopping at once never breaks the last complete one."""
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        on_signal(signum)
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)

    try:
        for sig in STOP_SIGNALS:
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not in the main thread: leave signals alone
        previous.clear()
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _steps_of_epochs(cfg: RecipeConfig, rows: int) -> RecipeConfig:
    """``cfg`` with ``step_scheduler.max_steps`` derived from ``num_epochs`` over ``rows`` training rows (the loader
    drops the rows that do not fill a last global batch), said once; unchanged when ``max_steps`` was written."""
    sched = cfg.step_scheduler
    if not sched.steps_from_epochs:
        if sched.num_epochs is not None:
            logger.info("step_scheduler.num_epochs %d: max_steps %d, written too, ends the run", sched.num_epochs,
                        sched.max_steps)
        return cfg
    assert sched.num_epochs is not None
    per_epoch = rows // sched.global_batch_size
    if per_epoch < 1:
        raise ConfigError(f"step_scheduler.num_epochs: {rows} training rows do not fill one global batch of "
                          f"{sched.global_batch_size}; allowed: more data, a smaller global_batch_size, or "
                          "step_scheduler.max_steps")
    steps = per_epoch * sched.num_epochs
    logger.info("step_scheduler.num_epochs %d -> max_steps %d (%d steps of %d rows per epoch, from %d rows)",
                sched.num_epochs, steps, per_epoch, sched.global_batch_size, rows)
    return cfg.model_copy(update={"step_scheduler": sched.model_copy(update={"max_steps": steps})})
