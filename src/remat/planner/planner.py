"""`Planner`: the least predicted recompute whose predicted whole-step peak fits a memory budget, per block.

1. Measure (once per recipe, `remat.planner.measure`): per block kind and candidate mode, the bytes kept for
   backward and the FLOPs recomputed, on fake tensors.
2. Choose (`remat.planner.choose`): over the Pareto frontier of per-block assignments, the one with the fewest
   FLOPs that saves at least what the budget asks against the no-checkpointing peak (additive model: peak without
   checkpointing minus the bytes saved).
3. Confirm with the estimate (`remat.estimate`), the judge: the peak is not additive (the block being recomputed
   holds its activations again; the peak may sit in the loss or the optimizer step). An assignment over budget asks
   for its overshoot more; one well under budget asks for its slack less; at most `MAX_ESTIMATES_PER_BUDGET`
   estimates per budget.
4. Compare with the uniform policies (none, attention, mlp, selective, full, full every 2nd / 4th block), each
   priced by the estimate: a fitting uniform policy with fewer FLOPs than the chosen mix replaces it, so the plan
   never recomputes more than the best uniform policy that fits.
5. On ``target="cuda"``, offloaded variants (``OFFLOADED``: full or selective with the kept inputs in host memory),
   priced by the estimate (which models the offload) and timed with the host<->device copies, twice the host bytes
   per micro-batch at ``host_bandwidth`` (not overlapped with compute: an upper bound); one replaces the plan when it
   fits and its recompute plus copies take less time. Only those whose recompute alone could beat the plan are priced.

Estimates are cached per policy, so planning several budgets for one recipe (`remat plan --budget ...`) reuses them.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Final

from remat.checkpointing import CheckpointingWarning, CheckpointPolicy
from remat.checkpointing.policy import Mode
from remat.errors import CheckpointingError, ConfigError

from remat.checkpointing.resolve import resolve_plan
from remat.estimate.api import MemoryEstimate, estimate_of_trace
from remat.estimate.compose import ParsedTrace, compose, parse
from remat.estimate.run import SimulatedRun
from remat.estimate.simulate import StepTrace, block_layout, check_simulable, simulate_step
from remat.estimate.choices import short_loss
from remat.estimate.settings import LOSS_TARGETS, StepSettings, report_settings
from remat.models import ModelConfig
from remat.recipes.config import RecipeConfig
from remat.planner.advice import moe_selective_note
from remat.planner.choose import assign, cheapest_saving, frontier, policy_of, total_cost, totals, uniform
from remat.planner.measure import BlockMeasurements, measure_blocks, quiet_checkpointing_log
from remat.planner.result import ActivationPlan, BlockChoice, Candidate
from remat.planner.spelling import RECIPE, Spelling
from remat.planner.timing import RecomputeRates
from remat.units import format_bytes

logger = logging.getLogger(__name__)

MAX_ESTIMATES_PER_BUDGET: Final[int] = 6
"""Estimates the search may run for one budget (besides the uniform policies)."""

DEFAULT_FLOPS_PER_SECOND: Final[dict[str, float]] = {"cuda": 4.0e14, "cpu": 5.0e10}
"""Throughput recompute is priced at: ``cuda`` about 40% of an H100's dense bf16 peak (989 TFLOP/s), what eager
transformer blocks reach; ``cpu`` a few cores. Only the reported seconds depend on it: the choice minimises FLOPs."""

DEFAULT_HOST_BANDWIDTH: Final[float] = 20e9
"""Host<->device copy rate (bytes/s) offloaded activations are priced at: about what pinned copies reach over PCIe
4.0 x16 one way (the H100 machine measured 57.1 s against 53.9 s for 2 x 16 GiB of copies at 256k tokens)."""

OFFLOADED: Final[tuple[tuple[str, Mode], ...]] = (
    ("full, inputs offloaded", "full"), ("selective, inputs offloaded", "selective"),
)
"""The offloaded policies a plan is compared with on a GPU: (label, mode with ``offload: true``)."""

UNIFORM: Final[tuple[tuple[str, Mode, int], ...]] = (
    ("none", "none", 1), ("attention", "attention", 1), ("mlp", "mlp", 1), ("selective", "selective", 1),
    ("full", "full", 1), ("full every 2nd", "full", 2),
)
"""The uniform policies a plan is compared with: (label, mode, every N blocks)."""

_RELAX_FRACTION: Final[float] = 0.02  # a fitting plan with more slack than this share of the budget tries cheaper


@dataclass
class Planner:
    """Plans for one step, ``recipe`` (validated; its checkpointing policy is ignored) on ``run``; `plan` answers
    one budget, reusing measurements and estimates across calls. `from_settings` plans the step of keyword settings
    (`remat.estimate.StepSettings`, the Python and ``remat plan MODEL`` edge)."""

    recipe: RecipeConfig
    """The step; every candidate priced is a copy with another policy (`RecipeConfig.with_checkpointing`)."""
    run: SimulatedRun
    flops_per_second: float | None = None
    host_bandwidth: float = DEFAULT_HOST_BANDWIDTH
    spelling: Spelling = RECIPE
    """How errors name the settings that would help (`remat.planner.spelling`): recipe keys by default."""
    attention_flops_per_second: float | None = None
    memory_bytes_per_second: float | None = None
    """Rates of the other op classes (`remat.planner.timing.RecomputeRates`; a calibration's); None: not priced
    apart from the matmuls."""
    rates: RecomputeRates = field(init=False)
    accumulation: int = field(init=False)
    """Micro-batches per optimizer step: recompute FLOPs and host copies are per step."""
    measurements: BlockMeasurements = field(init=False)
    _estimates: dict[str, MemoryEstimate] = field(init=False, default_factory=dict)
    _traces: list[ParsedTrace] = field(init=False, default_factory=list)
    """The steps simulated so far (policies `_composable`), which later policies are composed from."""
    _model_name: str = field(init=False, default="")

    @classmethod
    def from_settings(cls, model: ModelConfig, settings: StepSettings, flops_per_second: float | None = None,
                      **options: Any) -> Planner:
        """The planner of the step ``settings`` describe for ``model`` (its policy ignored): the recipe is built
        and validated once (`StepSettings.to_recipe`)."""
        settings = dataclasses.replace(settings, policy="none")
        return cls(settings.to_recipe(model), settings.run(), flops_per_second, **options)

    def __post_init__(self) -> None:
        if self.flops_per_second is None:
            self.flops_per_second = DEFAULT_FLOPS_PER_SECOND[self.run.target]
        self.rates = RecomputeRates(self.flops_per_second, self.attention_flops_per_second,
                                    self.memory_bytes_per_second)
        if isinstance(self.host_bandwidth, bool) or not (isinstance(self.host_bandwidth, (int, float))
                                                         and self.host_bandwidth > 0):
            raise ConfigError(f"host_bandwidth: got {self.host_bandwidth!r}; allowed: bytes per second, a number > 0")
        self.recipe = self.recipe.with_checkpointing(CheckpointPolicy(mode="none"))
        self.accumulation = check_simulable(self.recipe, self.run)
        self._model_name = self.recipe.model.describe()
        self.measurements = measure_blocks(self.recipe, self.run)
        self._frontier = frontier(self.measurements, self.rates.cost_of)
        logger.info("planner: measured %d block kind(s) of %d blocks in %.1f s; %d Pareto-optimal assignments",
                    len(self.measurements.kinds), self.measurements.num_blocks, self.measurements.seconds,
                    len(self._frontier))

    @property
    def step_flops(self) -> int:
        """Forward plus backward FLOPs of one optimizer step without checkpointing."""
        return self.measurements.step_flops * self.accumulation

    @property
    def loss(self) -> str:
        """The step's loss, short (``plain`` / ``fused``) where it is one of those."""
        return short_loss(self.recipe.loss_fn.target)

    def describe(self) -> str:
        """The step in one line: model, batch, strategy, target."""
        d, sched = self.recipe.distributed, self.recipe.step_scheduler
        ranks = "" if d.strategy == "single" else f" over {self.run.world_size} ranks"
        return (f"{self._model_name}: batch {sched.local_batch_size} x {self.recipe.dataset.seq_length}, "
                f"{d.strategy}{ranks}, target {self.run.target}")

    # --- estimates ---------------------------------------------------------------------------------------------

    def estimate(self, policy: CheckpointPolicy) -> MemoryEstimate:
        """The estimate of the step under ``policy`` (cached): composed from the steps simulated so far when each
        block's layout was in one of them (`remat.estimate.compose`), else simulated."""
        key = repr(sorted(policy.to_dict().items()))
        if key not in self._estimates:
            with quiet_checkpointing_log(), warnings.catch_warnings():
                # e.g. selective on MoE blocks: priced here; a plan that uses it says so itself (planner.advice)
                warnings.simplefilter("ignore", CheckpointingWarning)
                trace, how = self._composed(policy), "composed"
                if trace is None:
                    trace, how = self._simulated(policy), "simulated"
                estimate = estimate_of_trace(trace, report_settings(self.recipe.with_checkpointing(policy), self.run),
                                             model=self._model_name)
            logger.info("planner: estimate %d: %s -> predicted peak %s (%s in %.1f s)", len(self._estimates) + 1,
                        policy.describe(), format_bytes(estimate.peak_bytes), how, estimate.seconds)
            self._estimates[key] = estimate
        return self._estimates[key]

    def _simulated(self, policy: CheckpointPolicy) -> StepTrace:
        """The simulated step of ``policy``, kept for composing later policies. Once a whole step is kept, the
        simulation stops where the update starts (which no policy changes), and the step is composed from it.

        # NOTE [ The whole step composed from is the one that checkpoints nothing ]
        # Composition takes everything outside the blocks from the whole step, and it can only place a free that
        # some chosen segment recorded. The code outside the blocks can hold a tensor too: transformers' decoder
        # keeps its ``inputs_embeds`` until its forward returns. In bfloat16 no block of ``none`` saves that tensor
        # (the norm saves its float32 copy), so the step without checkpointing records the decoder's own release,
        # after the last block; under ``full`` the checkpoint of block 0 holds it until its backward, which hides
        # that release. Composed from a ``full`` step, a mix whose block 0 is ``none`` had no recorded free for it
        # and every mix was simulated again (2.8x slower plans on the seed recipe). The step that checkpoints
        # nothing records every release of the code outside the blocks, and a block that holds longer records its
        # own release in its own segment: it is always simulated first and whole.
        """
        recipe, run = self.recipe.with_checkpointing(policy), self.run
        if not _composable(policy):
            return simulate_step(recipe, run, blocks=True)
        if not self._traces and policy.enabled:
            self.estimate(CheckpointPolicy(mode="none"))  # the whole step composed from: see the NOTE below
        if self._traces:
            parsed = parse(simulate_step(recipe, run, blocks=True, stop_at_update=True))
            if parsed is not None:
                composed = compose(parsed.trace.layers, [self._traces[0], parsed])
                if composed is not None:
                    self._traces.append(parsed)
                    composed.seconds = parsed.trace.seconds + composed.seconds
                    return composed
        trace = simulate_step(recipe, run, blocks=True)
        parsed = parse(trace)
        if parsed is not None:
            self._traces.append(parsed)
        return trace

    def _composed(self, policy: CheckpointPolicy) -> StepTrace | None:
        """The trace of ``policy`` composed from the traces simulated so far, or None."""
        if not self._traces or not _composable(policy):
            return None
        search = self._traces[0].trace.blocks
        if not policy.enabled:
            layouts = [block_layout(None)] * len(search.blocks)
        else:
            try:
                plan = resolve_plan(policy, search, self._model_name)
            except CheckpointingError:
                return None  # the simulation says why
            applied = {layer.index: layer for layer in plan.layers}
            layouts = [block_layout(applied.get(block.index)) for block in search.blocks]
        if any(layout.offload or layout.spans_blocks for layout in layouts):
            return None  # offloaded or recomputed over several blocks
        return compose(layouts, self._traces)

    def uniform_candidates(self, budget_bytes: int) -> list[Candidate]:
        """The uniform policies that apply to this model, each priced by the estimate."""
        uniforms = self._uniforms()
        logger.info("planner: pricing the %d uniform policies that apply (%s)", len(uniforms),
                    ", ".join(label for label, _ in uniforms))
        return [self._candidate(label, modes, budget_bytes, is_uniform=True) for label, modes in uniforms]

    def _uniforms(self) -> list[tuple[str, tuple[Mode, ...]]]:
        """(label, per-block modes) of the `UNIFORM` policies that apply to this model."""
        out = []
        for label, mode, every in UNIFORM:
            if every > 1 and every > self.measurements.num_blocks // 2:
                continue
            modes = uniform(self.measurements, mode, every)
            if mode == "none" or any(m != "none" for m in modes):  # else no block has such a sub-module
                out.append((label, modes))
        return out

    # --- planning ----------------------------------------------------------------------------------------------

    def plan(self, budget_bytes: int, *, all_candidates: bool = False) -> ActivationPlan:
        """The plan for ``budget_bytes`` (see the module docstring). ``all_candidates`` prices every uniform policy
        (for a full frontier) instead of only those that could beat the chosen mix. Raises `ConfigError` when
        nothing fits, saying what the smallest plan needs and what would help."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise ConfigError(f"memory_budget: got {budget_bytes!r}; allowed: a number of bytes >= 1")
        self._refuse_below_floor(budget_bytes)
        logger.info("planner: searching for %s (at most %d estimates besides the uniform policies)",
                    format_bytes(budget_bytes), MAX_ESTIMATES_PER_BUDGET + 1)
        tried = self._search(budget_bytes)
        fitting = [c for c in tried if c.fits]
        best = min(fitting, key=self._seconds) if fitting else None
        uniforms = self.uniform_candidates(budget_bytes) if all_candidates else self._cheaper_uniforms(best,
                                                                                                   budget_bytes)
        for candidate in uniforms:
            if candidate.fits and (best is None or self._seconds(candidate) < self._seconds(best)):
                best = candidate
        offloaded = self._offloaded_candidates(best, budget_bytes, all_candidates)
        for candidate in offloaded:
            if candidate.fits and (best is None or self._seconds(candidate) < self._seconds(best)):
                best = candidate
        candidates = _unique([*uniforms, *offloaded, *tried])
        if best is None:
            raise self._nothing_fits(budget_bytes, candidates)
        return self._result(best, budget_bytes, candidates)

    def _refuse_below_floor(self, budget_bytes: int) -> None:
        """Say "nothing fits" after one estimate (two or three on a GPU: the offloaded policies) when the budget is
        below what any plan can reach: the full policy's peak less one block's activations without checkpointing
        (a per-layer mix peaks at most that much below full: only where the last block's recompute meets the
        loss). Above that floor the search runs as usual."""
        full = self._candidate("full", uniform(self.measurements, "full"), budget_bytes, is_uniform=True)
        largest_block = max((kind.cost("none").kept_bytes for kind in self.measurements.kinds), default=0)
        if full.fits or budget_bytes >= full.peak_bytes - largest_block:
            return
        floor = [full, *self._offloaded_candidates(None, budget_bytes, True)]
        if not any(candidate.fits for candidate in floor):
            raise self._nothing_fits(budget_bytes, floor, uniforms=False)

    def _search(self, budget_bytes: int) -> list[Candidate]:
        none = self._candidate("none", uniform(self.measurements, "none"), budget_bytes, is_uniform=True)
        if none.fits:
            return [none]
        tried = [none]
        needed = none.peak_bytes - budget_bytes
        floor = 0  # more than the savings of every assignment found over budget
        seen: set[tuple[Mode, ...]] = set()
        for _ in range(MAX_ESTIMATES_PER_BUDGET):
            choice = cheapest_saving(self._frontier, max(needed, floor))
            if choice is None:
                break
            modes = assign(choice, self.measurements)
            if modes in seen:
                break
            seen.add(modes)
            candidate = self._candidate("plan", modes, budget_bytes, is_uniform=False)
            tried.append(candidate)
            if candidate.fits:
                slack = budget_bytes - candidate.peak_bytes
                if slack <= _RELAX_FRACTION * budget_bytes:
                    break
                needed = choice.saved_bytes - slack // 2
            else:
                floor = max(floor, choice.saved_bytes + 1)
                needed = choice.saved_bytes + (candidate.peak_bytes - budget_bytes)
        return tried

    def _cheaper_uniforms(self, best: Candidate | None, budget_bytes: int) -> list[Candidate]:
        """The uniform policies that could beat ``best`` (fewer FLOPs), each priced by the estimate."""
        return [self._candidate(label, modes, budget_bytes, is_uniform=True) for label, modes in self._uniforms()
                if best is None or self._cost(modes) < best.recompute_cost]

    def _offloaded_candidates(self, best: Candidate | None, budget_bytes: int, everything: bool) -> list[Candidate]:
        """The `OFFLOADED` policies (on a GPU) whose recompute alone takes less time than ``best`` (all of them with
        ``everything``), each priced by the estimate, with its host<->device copies."""
        if self.run.target != "cuda":
            return []  # on the CPU the offload copies nothing and saves nothing
        assert self.flops_per_second is not None
        out = []
        for label, mode in OFFLOADED:
            modes = uniform(self.measurements, mode)
            if all(m == "none" for m in modes):
                continue
            if everything or best is None or self.rates.seconds(self._cost(modes)) < self._seconds(best):
                out.append(self._candidate(label, modes, budget_bytes, is_uniform=True, offload=True))
        return out

    def _seconds(self, candidate: Candidate) -> float:
        return candidate.seconds(self.rates.flops_per_second, self.host_bandwidth)

    def _cost(self, modes: tuple[Mode, ...]) -> int:
        """The recompute cost of ``modes`` per optimizer step, FLOP-equivalents (`RecomputeRates.cost`)."""
        return total_cost(modes, self.measurements, self.rates.cost_of) * self.accumulation

    def _candidate(self, label: str, modes: tuple[Mode, ...], budget_bytes: int, *, is_uniform: bool,
                   offload: bool = False) -> Candidate:
        policy = _uniform_policy(modes) if is_uniform else policy_of(modes)
        if offload:
            policy = dataclasses.replace(policy, offload=True)
        return self.price(label, policy, modes, budget_bytes, is_uniform=is_uniform)

    def price(self, label: str, policy: CheckpointPolicy, modes: tuple[Mode, ...], budget_bytes: int, *,
              is_uniform: bool = False) -> Candidate:
        """``policy`` (block ``i`` in mode ``modes[i]``) as a candidate for ``budget_bytes``: its estimate, and its
        recompute FLOPs and host<->device copies per optimizer step."""
        estimate = self.estimate(policy)
        flops = totals(modes, self.measurements)[1] * self.accumulation
        # every offloaded byte goes to the host and comes back, once per micro-batch
        transfer = 2 * estimate.host_peak_bytes * self.accumulation
        return Candidate(label, policy, modes, estimate.peak_bytes, flops, estimate.peak_bytes <= budget_bytes,
                         is_uniform, transfer, recompute_cost=self._cost(modes))

    def _result(self, best: Candidate, budget_bytes: int, candidates: list[Candidate]) -> ActivationPlan:
        m = self.measurements
        blocks = []
        for index, name in enumerate(m.block_names):
            kind = m.kind_of(index)
            mode = best.modes[index]
            cost, none = kind.cost(mode), kind.cost("none")
            blocks.append(BlockChoice(index=index, name=name, kind=kind.name, mode=mode, kept_bytes=cost.kept_bytes,
                                      saved_bytes=none.kept_bytes - cost.kept_bytes,
                                      recompute_flops=cost.recompute_flops,
                                      offload=best.policy.offload and mode != "none"))
        notes = []
        if self.run.target == "cuda":
            notes.append(f"offloaded policies are timed with their host<->device copies at "
                         f"{self.host_bandwidth / 1e9:g} GB/s, not overlapped with compute")
        moe_note = moe_selective_note(best.modes, m)
        if moe_note is not None:
            logger.warning("planner: %s", moe_note)
            notes.append(moe_note)
        if self.accumulation > 1:
            notes.append(f"FLOPs are per optimizer step ({self.accumulation} micro-batches); bytes per micro-batch")
        # compiled blocks: simulated as compiled, or as eager where dynamo runs them so (remat.estimate.compiled)
        notes += [note for note in self.estimate(best.policy).notes if note.startswith("compile:")]
        assert self.flops_per_second is not None
        return ActivationPlan(
            policy=best.policy, budget_bytes=budget_bytes, peak_bytes=best.peak_bytes,
            recompute_flops=best.recompute_flops, step_flops=self.step_flops,
            flops_per_second=self.flops_per_second, target=self.run.target, blocks=tuple(blocks),
            candidates=tuple(candidates), notes=tuple(notes), transfer_bytes=best.transfer_bytes,
            host_bandwidth=self.host_bandwidth, loss=self.loss, recompute_cost=best.recompute_cost,
            rates=self.rates if self.rates.by_class else None,
        )

    def _nothing_fits(self, budget_bytes: int, candidates: list[Candidate], *, uniforms: bool = True) -> ConfigError:
        """The error naming the smallest of ``candidates`` (and of every uniform policy, priced now, unless
        ``uniforms`` is False: below the floor, full is the smallest) and what would help."""
        priced = self.uniform_candidates(budget_bytes) if uniforms else []
        smallest = min([*candidates, *priced], key=lambda c: (c.peak_bytes, c.recompute_flops))
        words, batch = self.spelling, self.recipe.step_scheduler.local_batch_size
        strategy, seq_length = self.recipe.distributed.strategy, self.recipe.dataset.seq_length
        helps = []
        if batch > 1:
            helps.append(words.batch.format(now=batch))
        if strategy != "fsdp2":
            helps.append(words.fsdp)
        elif self.run.world_size > 1:
            helps.append(words.more_ranks.format(ranks=self.run.world_size))
        if self.recipe.loss_fn.target == LOSS_TARGETS["plain"]:  # not a loss that holds no logits already
            helps.append(words.fused_loss)
        if seq_length > 2:
            helps.append(words.seq_length.format(now=seq_length))
        described = smallest.policy.describe()
        name = smallest.label if smallest.label == described else f"{smallest.label}: {described}"
        return ConfigError(
            f"{words.budget}: nothing fits {format_bytes(budget_bytes)}; the smallest plan ({name}) needs "
            f"{format_bytes(smallest.peak_bytes)} predicted. What would help: {'; '.join(helps)}")


def _composable(policy: CheckpointPolicy) -> bool:
    """Whether steps of ``policy`` are made of per-block segments that other policies' steps share: not offloaded
    (host copies), not tiled (the final norm outside the blocks is tiled too) and not recomputed over segments of
    several blocks."""
    return not policy.offload and not policy.tiled and policy.segments is None and not any(
        override.offload for override in policy.layers)


def _uniform_policy(modes: tuple[Mode, ...]) -> CheckpointPolicy:
    """One mode on every N-th block spelled as such (``{mode: full, every_n_layers: 2}``) when ``modes`` follow
    that pattern, else per layer (some blocks could not take the mode)."""
    active = [mode for mode in modes if mode != "none"]
    if not active:
        return CheckpointPolicy(mode="none")
    for every in range(1, len(modes) + 1):
        if tuple(active[0] if i % every == 0 else "none" for i in range(len(modes))) == modes:
            return CheckpointPolicy(mode=active[0], every_n_layers=every)
    return policy_of(modes)


def _unique(candidates: list[Candidate]) -> list[Candidate]:
    """One entry per policy (the first label given to it wins: uniform names before "plan")."""
    seen: dict[str, Candidate] = {}
    for candidate in candidates:
        seen.setdefault(repr(sorted(candidate.policy.to_dict().items())), candidate)
    return list(seen.values())
