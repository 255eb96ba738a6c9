"""The longest sequence whose predicted peak fits a memory budget: "how long can I train?".

A direct search (bisection over `estimate_memory`) is exact but slow at long lengths: the simulation's time grows
with the sequence (with sequence tiling, with its number of tiles: ~340 s for one estimate at 512k tokens of the
Llama-3.2-1B shape on 2 cores). So the search uses what a step's memory looks like as a function of the sequence
length T: with attention linear in memory (flash / memory-efficient kernels, no ``[T, T]`` mask), every tensor of
the step is either independent of T (parameters, gradients, optimizer state, one tile's intermediates, one loss
chunk) or proportional to it (hidden states, kept block inputs), so the memory at any moment is ``a + b * T`` and
the peak of a phase of the step (forward, loss, backward, optimizer step) is the largest of such lines: piecewise
affine, convex, and affine once T is long enough for the moment with the steepest line to dominate.

The method (`find_longest`):

1. estimate the step at three lengths, a window of ``(s, s + s/4, s + s/2)`` tokens (default ``s`` = 32,768, or
   16 tiles with tiling, rounded to the granularity; tiles stay ``tile_tokens`` long, so each sample runs the
   same per-tile code as the long run does);
2. per phase, fit the line through the two longer samples and check that the shorter one lies on it (within
   ``16 MiB + 0.2 %``: the allocator model's rounding); if a phase is not collinear, the window moves up
   (doubles) once, then the search falls back to bisection with direct estimates;
3. solve ``max over phases of (a + b * T) = budget`` for T, round down to the granularity (1,024 tokens, or the
   tile length with tiling), and cap it at the estimate's size limit;
4. if the answer lies below the window, the window moves down below it once (extrapolating downwards across a
   kink is not safe), then bisection;
5. with ``confirm``, estimate directly at the answer and at the answer plus the granularity: the answer is
   *confirmed* when the first fits and the second does not; otherwise the two direct estimates give a local line
   and the answer is corrected (a secant step, at most four rounds).

The error of an extrapolated answer: a moment whose line is steeper than any the window's samples reach, but
which only dominates beyond the window, would make the true peak higher than the extrapolation (the answer too
long). The collinearity check cannot see it; ``--confirm`` can. benchmarks/bench_longest.py measures the
extrapolated peak against direct estimates at 256k and 512k tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from remat.checkpointing import parse_policy
from remat.checkpointing.tiling import default_tile_tokens
from remat.errors import ConfigError, RematError
from remat.estimate.limits import MAX_MICRO_BATCH_TOKENS
from remat.estimate.sampling import PeakSample, PeakSampler
from remat.estimate.settings import StepSettings
from remat.models import ModelConfig
from remat.models.build import resolve_model_config

logger = logging.getLogger(__name__)

BASE_GRANULARITY: Final[int] = 1024
"""Answers are multiples of this many tokens (of the tile length with tiling)."""
WINDOW_START: Final[int] = 32768
"""The first sample length (at least 16 tiles with tiling)."""
MIN_TILES: Final[int] = 16
COLLINEAR_BYTES: Final[int] = 16 * 2**20
COLLINEAR_SHARE: Final[float] = 0.002
MAX_SECANT_ROUNDS: Final[int] = 4

Method = Literal["extrapolated", "confirmed", "corrected", "bisection", "not modelled", "refused", "nothing fits"]


@dataclass(frozen=True)
class PhaseLine:
    """The peak of one phase of the step as ``fixed_bytes + bytes_per_token * seq_length``, fitted through the two
    longer samples; ``deviation_bytes``: how far the shortest sample lies from the line."""

    phase: str
    fixed_bytes: float
    bytes_per_token: float
    deviation_bytes: float

    def at(self, seq_length: int) -> float:
        """The line's peak at ``seq_length`` tokens."""
        return self.fixed_bytes + self.bytes_per_token * seq_length


@dataclass(frozen=True)
class LongestAnswer:
    """The longest sequence (tokens per row, at the settings' batch size) whose predicted peak fits ``capacity_bytes``.

    ``seq_length`` is None when the setting is not modelled, or refused when built or run (``reason`` says why),
    and 0 when not even one
    granularity step fits. ``method``: how it was found (see the module docstring); ``predicted_peak_bytes``: the
    peak at the answer (from the line, or the direct estimate when there is one); ``direct``: the direct estimates
    made (bisection, confirmation).
    """

    label: str
    settings: StepSettings
    capacity_bytes: int
    seq_length: int | None
    method: Method
    granularity: int
    predicted_peak_bytes: int | None = None
    binding_phase: str | None = None
    lines: tuple[PhaseLine, ...] = ()
    samples: tuple[PeakSample, ...] = ()
    direct: tuple[PeakSample, ...] = ()
    collinear: bool | None = None
    at_limit: bool = False
    reason: str = ""
    notes: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def bytes_per_token(self) -> float | None:
        """The slope of the binding phase's line (the memory each further token costs)."""
        line = next((ln for ln in self.lines if ln.phase == self.binding_phase), None)
        return line.bytes_per_token if line else None

    @property
    def fixed_bytes(self) -> float | None:
        """The binding line's value at zero tokens (what does not grow with the sequence)."""
        line = next((ln for ln in self.lines if ln.phase == self.binding_phase), None)
        return line.fixed_bytes if line else None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (bytes as integers)."""
        from remat.estimate.api import settings_dict

        return {
            "name": self.label,
            "settings": settings_dict(dataclasses.replace(self.settings, seq_length=self.seq_length or 0)),
            "capacity_bytes": self.capacity_bytes,
            "longest_seq_length": self.seq_length,
            "longest_tokens": None if self.seq_length is None else self.seq_length * self.settings.batch_size,
            "method": self.method,
            "granularity": self.granularity,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "binding_phase": self.binding_phase,
            "bytes_per_token": None if self.bytes_per_token is None else round(self.bytes_per_token, 1),
            "fixed_bytes": None if self.fixed_bytes is None else round(self.fixed_bytes),
            "collinear": self.collinear,
            "at_limit": self.at_limit,
            "lines": [dataclasses.asdict(ln) for ln in self.lines],
            "samples": [s.to_dict() for s in self.samples],
            "direct": [s.to_dict() for s in self.direct],
            "reason": self.reason,
            "notes": list(self.notes),
            "seconds": round(self.seconds, 1),
        }


@dataclass
class _Search:
    """One setting's search state."""

    label: str
    settings: StepSettings
    granularity: int
    window: tuple[int, ...]
    limit: int
    moves: int = 0
    notes: list[str] = field(default_factory=list)


def find_longest(model: ModelConfig, rows: Sequence[tuple[str, StepSettings]], capacity_bytes: int, *,
                 confirm: bool = False, granularity: int | None = None, window_start: int | None = None,
                 jobs: int = 1) -> list[LongestAnswer]:
    """The longest fitting sequence of each (label, settings) row (see the module docstring for the method).

    ``granularity``: round answers down to a multiple of it (default: 1,024 tokens, or the tile length with
    tiling); ``window_start``: the first sample length (default 32,768, at least 16 tiles);
    ``jobs``: worker processes for the estimates. A row the estimate does not model (e.g. an offloading policy
    before the estimate models it) is answered ``method="not modelled"`` with the reason, not a number.
    """
    if capacity_bytes <= 0:
        raise ConfigError(f"--fits: got {capacity_bytes} bytes; allowed: a positive size (e.g. 80GiB)")
    answers: dict[int, LongestAnswer] = {}
    searches: dict[int, _Search] = {}
    for index, (label, settings) in enumerate(rows):
        settings = _normalized(model, settings)
        reason = _not_modelled(model, settings)
        if reason:
            answers[index] = LongestAnswer(label, settings, capacity_bytes, None, "not modelled", 0, reason=reason)
            continue
        g = _granularity(model, settings, granularity)
        searches[index] = _Search(label, settings, g, _window(model, settings, g, window_start),
                                  limit=(MAX_MICRO_BATCH_TOKENS // settings.batch_size) // g * g)
    with PeakSampler(model, jobs) as sampler:
        # The first windows of every row in one batch, so that the workers stay busy.
        try:
            sampler.many([(s.settings, n) for s in searches.values() for n in s.window])
        except RematError:
            pass  # remembered per request; the row it belongs to is answered "refused" below
        for index, search in searches.items():
            try:
                answers[index] = _search(sampler, search, capacity_bytes, confirm)
            except RematError as err:  # refused when built or run (e.g. tiling an MoE block): said, not a number
                answers[index] = LongestAnswer(search.label, search.settings, capacity_bytes, None, "refused",
                                               search.granularity, reason=str(err))
    return [answers[i] for i in range(len(rows))]


def _search(sampler: PeakSampler, search: _Search, capacity: int, confirm: bool) -> LongestAnswer:
    while True:
        samples = sampler.many([(search.settings, n) for n in search.window])
        lines = fit_lines(samples)
        collinear = all(ln.deviation_bytes <= _tolerance(ln.at(samples[0].seq_length)) for ln in lines)
        raw, phase = solve(lines, capacity)
        if not collinear:
            worst = max(lines, key=lambda ln: ln.deviation_bytes / _tolerance(ln.at(samples[0].seq_length)))
            search.notes.append(f"samples at {_lengths(search.window)} tokens are not collinear (phase {worst.phase}: "
                                f"{worst.deviation_bytes / 2**20:.0f} MiB off the line)")
            quadratic = _quadratic_attention(samples)
            if quadratic is not None:  # a longer window is no straighter: search the estimates themselves
                search.notes.append(quadratic)
                return _bisection(sampler, search, capacity, samples, lines)
            if search.moves == 0 and 2 * search.window[0] <= search.limit:
                search.moves += 1
                search.window = tuple(2 * n for n in search.window)
                continue
            return _bisection(sampler, search, capacity, samples, lines)
        if raw is None:
            return _answer(search, capacity, 0, "nothing fits", lines, samples, phase, collinear=True,
                           reason=f"the {phase} phase alone, at any length, peaks above the budget")
        answer = search.limit if math.isinf(raw) else min(int(raw) // search.granularity * search.granularity,
                                                          search.limit)
        if answer < search.window[0] and answer >= search.granularity:
            if search.moves < 2 and search.window[0] > 2 * search.granularity:
                search.moves += 2  # a window below the answer; no further move
                search.notes.append(f"the answer ({answer:,}) lies below the window {_lengths(search.window)}: "
                                    "sampled again below it")
                search.window = _window_below(answer, search.granularity)
                continue
            return _bisection(sampler, search, capacity, samples, lines)
        if answer < search.granularity:
            return _answer(search, capacity, 0, "nothing fits", lines, samples, phase, collinear=True,
                           reason=f"not even {search.granularity} tokens fit")
        result = _answer(search, capacity, answer, "extrapolated", lines, samples, phase, collinear=True,
                         peak=max(ln.at(answer) for ln in lines))
        return _confirmed(sampler, search, result) if confirm else result


def fit_lines(samples: Sequence[PeakSample]) -> tuple[PhaseLine, ...]:
    """Per phase present in every sample, the line through the two longest samples and how far the shortest lies
    from it (samples in increasing length; at least two)."""
    if len(samples) < 2:
        raise ValueError("fit_lines needs at least two samples")
    phases = [p for p in samples[-1].phase_peaks if all(p in s.phase_peaks for s in samples)]
    t1, t2, t3 = samples[0].seq_length, samples[-2].seq_length, samples[-1].seq_length
    lines = []
    for phase in phases:
        p2, p3 = samples[-2].phase_peaks[phase], samples[-1].phase_peaks[phase]
        slope = (p3 - p2) / (t3 - t2)
        fixed = p3 - slope * t3
        deviation = abs(samples[0].phase_peaks[phase] - (fixed + slope * t1)) if len(samples) > 2 else 0.0
        lines.append(PhaseLine(phase, fixed, slope, deviation))
    return tuple(lines)


def solve(lines: Sequence[PhaseLine], capacity: int) -> tuple[float | None, str | None]:
    """The length at which the highest line reaches ``capacity`` and the phase whose line does (None when a line
    that does not grow is above ``capacity`` already; ``inf`` when no line grows)."""
    best, phase = math.inf, None
    for line in lines:
        if line.bytes_per_token <= 0:
            if line.fixed_bytes > capacity:
                return None, line.phase
            continue
        at = (capacity - line.fixed_bytes) / line.bytes_per_token
        if at < best:
            best, phase = at, line.phase
    if best < 0:
        return None, phase
    return best, phase


def _bisection(sampler: PeakSampler, search: _Search, capacity: int, samples: Sequence[PeakSample],
               lines: Sequence[PhaseLine]) -> LongestAnswer:
    """The largest multiple of the granularity whose direct estimate fits (the samples seed the bounds)."""
    g = search.granularity
    logger.info("%s: bisection with direct estimates", search.label)
    known = {s.seq_length: s for s in samples}
    fitting = [n for n, s in known.items() if s.peak_bytes <= capacity]
    failing = [n for n, s in known.items() if s.peak_bytes > capacity]
    low = max(fitting, default=0)
    high = min(failing, default=0)
    while not high:  # every sample fits: double until one does not (or the limit)
        probe = min(2 * max(low, g), search.limit)
        sample = sampler.one(search.settings, probe)
        known[probe] = sample
        if sample.peak_bytes > capacity:
            high = probe
        elif probe == search.limit:
            return _answer(search, capacity, probe, "bisection", lines, samples, None, collinear=False,
                           peak=sample.peak_bytes, direct=known, at_limit=True)
        else:
            low = probe
    while high - low > g:
        middle = (low + high) // 2 // g * g
        if middle <= low:
            break
        sample = sampler.one(search.settings, middle)
        known[middle] = sample
        low, high = (middle, high) if sample.peak_bytes <= capacity else (low, middle)
    peak = known[low].peak_bytes if low in known else None
    return _answer(search, capacity, low, "bisection" if low else "nothing fits", lines, samples, None,
                   collinear=False, peak=peak, direct=known)


def _confirmed(sampler: PeakSampler, search: _Search, result: LongestAnswer) -> LongestAnswer:
    """Check ``result`` with direct estimates at it and one granularity step beyond; correct it by secant steps."""
    g, answer = search.granularity, result.seq_length or 0
    direct: dict[int, PeakSample] = {}
    for round_ in range(MAX_SECANT_ROUNDS):
        low, high = sampler.many([(search.settings, answer), (search.settings, answer + g)])
        direct.update({low.seq_length: low, high.seq_length: high})
        fits_low, fits_high = low.peak_bytes <= result.capacity_bytes, high.peak_bytes <= result.capacity_bytes
        if fits_low and (not fits_high or answer + g > search.limit):
            method: Method = "confirmed" if round_ == 0 else "corrected"
            return dataclasses.replace(result, seq_length=answer, method=method, predicted_peak_bytes=low.peak_bytes,
                                       direct=_sorted(direct), at_limit=answer + g > search.limit,
                                       seconds=result.seconds + sum(s.seconds for s in direct.values()))
        slope = (high.peak_bytes - low.peak_bytes) / g
        target = (result.capacity_bytes - low.peak_bytes) / slope + answer if slope > 0 else answer + g
        step = int(target) // g * g
        if step == answer:
            step = answer - g if not fits_low else answer + g
        answer = max(g, min(step, search.limit))
    note = (f"direct estimates did not settle the answer in {MAX_SECANT_ROUNDS} rounds: "
            + ", ".join(f"{n:,} tokens -> {s.peak_bytes / 2**30:.2f} GiB" for n, s in sorted(direct.items())))
    return dataclasses.replace(result, direct=_sorted(direct), notes=(*result.notes, note),
                               seconds=result.seconds + sum(s.seconds for s in direct.values()))


def _answer(search: _Search, capacity: int, seq_length: int, method: Method, lines: Sequence[PhaseLine],
            samples: Sequence[PeakSample], phase: str | None, *, collinear: bool, peak: float | None = None,
            direct: dict[int, PeakSample] | None = None, at_limit: bool = False, reason: str = "") -> LongestAnswer:
    at_limit = at_limit or (method == "extrapolated" and seq_length >= search.limit)
    notes = list(search.notes)
    if at_limit:
        notes.append(f"capped at the estimate's limit of {MAX_MICRO_BATCH_TOKENS:,} tokens per micro-batch")
    return LongestAnswer(
        label=search.label, settings=search.settings, capacity_bytes=capacity, seq_length=seq_length, method=method,
        granularity=search.granularity, predicted_peak_bytes=None if peak is None else int(peak),
        binding_phase=phase, lines=tuple(lines), samples=tuple(samples), direct=_sorted(direct or {}),
        collinear=collinear, at_limit=at_limit, reason=reason, notes=tuple(notes),
        seconds=sum(s.seconds for s in (*samples, *(direct or {}).values())))


def _quadratic_attention(samples: Sequence[PeakSample]) -> str | None:
    """Why the peak cannot be a line in the length when attention ran PyTorch's math kernel (it materialises the
    ``[seq, seq]`` scores), else None."""
    if not any(sample.attention_kernels.get("math") for sample in samples):
        return None
    return ("attention runs PyTorch's math kernel at these settings (e.g. float32 with grouped-query heads, or an "
            "explicit mask): its [seq, seq] scores grow with the square of the length, so the answer comes from "
            "bisection over direct estimates; bfloat16 or float16 (--dtype, --autocast) gets the flash kernel, "
            "whose memory is linear")


def _sorted(samples: dict[int, PeakSample]) -> tuple[PeakSample, ...]:
    return tuple(s for _, s in sorted(samples.items()))


def _tolerance(peak: float) -> float:
    return COLLINEAR_BYTES + COLLINEAR_SHARE * abs(peak)


def _lengths(window: Sequence[int]) -> str:
    return "/".join(f"{n:,}" for n in window)


def _normalized(model: ModelConfig, settings: StepSettings) -> StepSettings:
    """``settings`` validated, with the model's dtype and autocast filled in (as `estimate_memory` does)."""
    settings.validate()
    return dataclasses.replace(settings, dtype=settings.dtype or model.dtype, autocast=settings.autocast or model.autocast)


def _not_modelled(model: ModelConfig, settings: StepSettings) -> str:
    """Why the estimate refuses ``settings`` (`remat.estimate.simulate.check_simulable`), or ``""``."""
    from remat.estimate.simulate import check_simulable

    try:
        check_simulable(settings.to_recipe(model), settings.run())
    except ConfigError as err:
        return str(err)
    return ""


def tile_tokens(model: ModelConfig, settings: StepSettings) -> int | None:
    """The tile length of a tiled policy (its ``tile_tokens``, else the model's hidden size), None untiled."""
    policy = parse_policy(settings.policy)
    if not policy.tiled:
        return None
    if policy.tile_tokens:
        return policy.tile_tokens
    return default_tile_tokens(int(resolve_model_config(model).get_text_config().hidden_size))


def _granularity(model: ModelConfig, settings: StepSettings, given: int | None) -> int:
    if given is not None:
        if not (isinstance(given, int) and given >= 1):
            raise ConfigError(f"--granularity: got {given!r}; allowed: an integer >= 1 (tokens)")
        return given
    tile = tile_tokens(model, settings)
    return tile or BASE_GRANULARITY


def _window(model: ModelConfig, settings: StepSettings, granularity: int, start: int | None) -> tuple[int, ...]:
    tile = tile_tokens(model, settings) or 0
    first = start or max(WINDOW_START, MIN_TILES * tile)
    first = max(granularity, -(-first // granularity) * granularity)
    step = max(granularity, first // 4 // granularity * granularity)
    return first, first + step, first + 2 * step


def _window_below(answer: int, granularity: int) -> tuple[int, ...]:
    """Three lengths below ``answer`` (the top one at about three quarters of it)."""
    step = max(granularity, answer // 4 // granularity * granularity)
    first = max(granularity, answer // 4 // granularity * granularity)
    return first, first + step, first + 2 * step
