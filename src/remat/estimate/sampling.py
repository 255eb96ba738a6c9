"""Estimates of one step at several sequence lengths, side by side in worker processes.

`PeakSampler` answers "what is the predicted peak of ``settings`` at ``seq_length`` tokens?" for many
(settings, length) pairs at once. Each answer is a full `remat.estimate.api.estimate_memory` run (the recipe's own
step on fake tensors, replayed through the allocator model); only the figures the length search needs are kept
(`PeakSample`). With ``jobs > 1`` the requests run in that many forked worker processes (the simulation is pure
Python on fake tensors: one core each), in the order given.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import multiprocessing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from remat.errors import RematError
from remat.estimate.settings import StepSettings
from remat.models import ModelConfig
from remat.units import format_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeakSample:
    """The predicted peak of one step at ``seq_length`` tokens per row, and the peak of each phase of it."""

    seq_length: int
    peak_bytes: int
    phase: str
    phase_peaks: dict[str, int]
    seconds: float
    attention_kernels: dict[str, int] = field(default_factory=dict)
    """Calls per CUDA attention kernel the step ran (`remat.estimate.attention`; empty on the CPU target)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (bytes as integers)."""
        return {"seq_length": self.seq_length, "peak_bytes": self.peak_bytes, "peak_gib": round(self.peak_bytes / 2**30, 4),
                "phase": self.phase, "phase_peaks": dict(self.phase_peaks), "seconds": round(self.seconds, 2)}


def sample_peak(model: ModelConfig, settings: StepSettings, seq_length: int) -> PeakSample:
    """The steady-state peak of ``settings`` at ``seq_length`` tokens per row, as `estimate_memory` predicts it
    (``settings`` normalised by the caller: dtype and autocast filled in); only the one replay it needs is made."""
    from remat.estimate.replay import replay
    from remat.estimate.simulate import simulate_step

    settings = dataclasses.replace(settings, seq_length=seq_length)
    settings.validate()
    trace = simulate_step(settings.to_recipe(model), settings.run())
    steady = replay(trace.events, trace.marks, kind="cuda" if settings.target == "cuda" else "exact",
                    steady_state=True)
    return PeakSample(seq_length, steady.peak_bytes, steady.phase, dict(steady.phase_peaks), trace.seconds,
                      dict(trace.attention_kernels))


def _outcome(run: Callable[[], PeakSample]) -> PeakSample | RematError:
    """The sample, or the user-fixable error (`remat.errors.RematError`) that refused it; other errors propagate."""
    try:
        return run()
    except RematError as err:
        return err


def _tiled(settings: StepSettings) -> bool:
    from remat.checkpointing import parse_policy

    return parse_policy(settings.policy).tiled


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)


class PeakSampler:
    """Runs `sample_peak` for many requests, in ``jobs`` worker processes when ``jobs > 1``.

    Use as a context manager (the workers live until it exits). Results of identical requests are remembered, so a
    length sampled once is never simulated again.
    """

    def __init__(self, model: ModelConfig, jobs: int = 1) -> None:
        self.model = model
        self.jobs = max(1, jobs)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        # keyed by the settings object's identity (settings hold mappings, so they do not hash); the object is kept
        self._done: dict[tuple[int, int], tuple[StepSettings, PeakSample | RematError]] = {}

    def __enter__(self) -> PeakSampler:
        if self.jobs > 1:
            # fork: the workers inherit the imported torch and transformers instead of importing them again
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.jobs, mp_context=multiprocessing.get_context("fork"), initializer=_worker_init)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def many(self, requests: Sequence[tuple[StepSettings, int]]) -> list[PeakSample]:
        """The samples of ``requests`` ((settings, seq_length) pairs), in order. A request refused with a
        `remat.errors.RematError` (e.g. tiling an MoE block) is remembered and raised whenever it is asked for; the
        other requests of the batch still run."""
        todo = {(id(s), n): (s, n) for s, n in requests if (id(s), n) not in self._done}
        if self._pool is None or len(todo) < 2:
            for key, (settings, length) in todo.items():
                outcome = _outcome(lambda s=settings, n=length: sample_peak(self.model, s, n))
                self._record(key, settings, length, outcome)
        else:
            # the costliest first (tiled steps, longer sequences), so that no long one is left for the end
            order = sorted(todo, key=lambda k: (_tiled(todo[k][0]), todo[k][1]), reverse=True)
            futures = {k: (todo[k][0], self._pool.submit(sample_peak, self.model, *todo[k])) for k in order}
            for key, (settings, future) in futures.items():
                self._record(key, settings, todo[key][1], _outcome(future.result))
        results = [self._done[(id(s), n)][1] for s, n in requests]
        for result in results:
            if isinstance(result, RematError):
                raise result  # the first user-fixable error of these requests (the others are kept)
        return results  # type: ignore[return-value]

    def _record(self, key: tuple[int, int], settings: StepSettings, length: int,
                outcome: PeakSample | RematError) -> None:
        """Keep ``outcome`` and say so: one progress line per estimate made."""
        self._done[key] = (settings, outcome)
        result = (f"peak {format_bytes(outcome.peak_bytes)} ({outcome.seconds:.1f} s)"
                  if isinstance(outcome, PeakSample) else "refused")
        logger.info("estimate %d: %s tokens, %s -> %s", len(self._done), f"{length:,}", settings.describe(), result)

    def one(self, settings: StepSettings, seq_length: int) -> PeakSample:
        """The sample of one request."""
        return self.many([(settings, seq_length)])[0]
