"""What `remat profile` compares and prints: the settings (``--policies`` and, for ``auto``, ``--budget``), each
setting's measured steps, and the side-by-side table, JSON and PNG (peak memory against median step time).

Running the settings is `remat.planner.profile_run`; this module loads neither torch nor transformers, so a mistake
in ``--policies`` is said at once.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remat.checkpointing.policy import AUTO, POLICY_STRINGS, CheckpointPolicy, parse_policy
from remat.errors import ConfigError
from remat.planner.calibration import TimingSample
from remat.planner.result import GIB, _columns

BASELINE = "none"
"""The setting the others are compared with (ratios) and the calibration measures recompute against."""


@dataclass(frozen=True)
class Setting:
    """One column of the comparison: a concrete ``policy``, or ``auto`` planned for ``budget`` (the text given:
    ``20GiB``, ``0.8``; None: the recipe's ``activation_checkpointing.memory_budget``)."""

    label: str
    policy: CheckpointPolicy | None = None
    budget: str | None = None

    @property
    def is_auto(self) -> bool:
        return self.policy is None


def parse_settings(policies: str | Sequence[str], budgets: Sequence[str] = ()) -> list[Setting]:
    """The settings ``--policies`` names (comma-separated; the spellings of ``distributed.activation_checkpointing``,
    a policy mapping in YAML flow style such as ``{mode: full, every_n_layers: 2}`` included, plus ``auto``), ``auto``
    once per budget (labelled ``auto@20GiB`` when there are several). `ConfigError` naming ``--policies`` for an
    unknown name, a repeated one, ``--budget`` without ``auto``, or nothing at all."""
    names = [part for item in ([policies] if isinstance(policies, str) else policies) for part in _split(item)]
    if not names:
        raise ConfigError(f"--policies: empty; allowed: a comma-separated list of {_allowed()}")
    settings: list[Setting] = []
    for name in names:
        if name.lower() == AUTO:
            settings += [Setting(f"auto@{b}" if len(budgets) > 1 else AUTO, None, b) for b in (budgets or [None])]
            continue
        if name.startswith("{"):
            policy = parse_policy(_mapping(name), key="--policies")
            settings.append(Setting(policy.describe(), policy))
            continue
        try:
            policy = parse_policy(_YAML_BOOLS.get(name.lower(), name), key="--policies")
        except ConfigError as err:
            raise ConfigError(f"{err}; or {AUTO} (planned for each --budget), comma-separated") from None
        settings.append(Setting(name.lower(), policy))
    labels = [s.label for s in settings]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ConfigError(f"--policies: {', '.join(repeated)} given more than once; name each setting once")
    if budgets and not any(s.is_auto for s in settings):
        raise ConfigError("--budget: only 'auto' is planned for a budget; add auto to --policies or drop --budget")
    return settings


_YAML_BOOLS = {"true": True, "false": False}  # as the recipe key reads them


def _split(text: str) -> list[str]:
    """``text`` split at the commas outside braces, each part stripped, empty ones dropped."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def _mapping(text: str) -> Any:
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"--policies: {text!r} is not a YAML mapping ({str(err).splitlines()[0]}); write e.g. "
                          "{mode: full, every_n_layers: 2}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--policies: {text!r} is not a mapping; write e.g. {{mode: full, every_n_layers: 2}}")
    return value


def _allowed() -> str:
    return ", ".join(["true", "false", *POLICY_STRINGS, AUTO])


@dataclass(frozen=True)
class PlanSummary:
    """What the planner chose for an ``auto`` setting, and what it predicted."""

    budget_bytes: int
    policy: str
    predicted_peak_bytes: int
    predicted_recompute_flops: int

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget_bytes, "budget_gib": round(self.budget_bytes / GIB, 3),
                "policy": self.policy, "predicted_peak_bytes": self.predicted_peak_bytes,
                "predicted_peak_gib": round(self.predicted_peak_bytes / GIB, 3),
                "predicted_recompute_flops": self.predicted_recompute_flops}


@dataclass
class SettingResult:
    """One setting's measured steps. ``step_times_s``, ``peak_bytes`` and ``losses`` hold every step of every
    round (``steps_per_round`` each; 0: one round), the first ``warmup`` of each round included (left out of the
    medians and the peak); ``step_flops`` were counted on the first step (torch's FLOP counter: matmuls and
    attention, forward, backward and recompute, all micro-batches). ``error``: why it did not run (nothing fits the
    budget, out of memory)."""

    label: str
    policy: dict[str, Any] | None = None
    policy_text: str = ""
    warmup: int = 1
    steps_per_round: int = 0
    step_times_s: list[float] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    step_flops: int = 0
    step_memory_bytes: int = 0
    """Bytes the first step's memory-bound ops wrote (`remat.planner.measure.count_ops`)."""
    memory_source: str = ""
    plan: PlanSummary | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and bool(self.timed(self.step_times_s))

    def timed(self, values: Sequence[Any]) -> list[Any]:
        """``values`` (one per step) without each round's warm-up steps."""
        per_round = self.steps_per_round or len(values)
        return [value for index, value in enumerate(values) if index % per_round >= self.warmup]

    @property
    def median_step_s(self) -> float:
        """The median step time after the warm-up steps (of every round)."""
        return statistics.median(self.timed(self.step_times_s))

    @property
    def peak(self) -> int:
        """The largest step peak after the warm-up steps (the first step builds the optimizer state and runs under
        the FLOP counter, whose module hooks hold references of their own)."""
        return max(self.timed(self.peak_bytes))

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.median_step_s

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the raw steps, and the medians and peak when it ran."""
        out: dict[str, Any] = {"label": self.label, "policy": self.policy, "policy_text": self.policy_text}
        if self.plan is not None:
            out["plan"] = self.plan.to_dict()
        if self.error:
            out["error"] = self.error
        if self.ok:
            out.update(peak_bytes=self.peak, peak_gib=round(self.peak / GIB, 4),
                       median_step_s=round(self.median_step_s, 6), tokens_per_s=round(self.tokens_per_s, 1),
                       step_flops=self.step_flops, step_memory_bytes=self.step_memory_bytes)
        out.update(memory_source=self.memory_source, warmup_steps=self.warmup, steps_per_round=self.steps_per_round,
                   tokens_per_step=self.tokens_per_step,
                   step_times_s=[round(t, 6) for t in self.step_times_s], step_peak_bytes=self.peak_bytes,
                   losses=self.losses)
        return out


@dataclass
class ProfileReport:
    """Every setting of one `remat profile` run, on ``device`` with ``torch_version``."""

    recipe: str
    device: str
    target: str
    torch_version: str
    steps: int
    warmup: int
    results: list[SettingResult]
    rounds: int = 1

    def baseline(self) -> SettingResult | None:
        return next((r for r in self.results if r.label == BASELINE and r.ok), None)

    def samples(self) -> list[TimingSample]:
        """The settings that ran, as calibration samples."""
        return [TimingSample(r.label, r.median_step_s, r.step_flops, r.step_memory_bytes) for r in self.results
                if r.ok]

    def loss_difference(self) -> float | None:
        """The largest difference of any step's loss between settings that ran (every policy computes the same
        gradients, so it should be ~0); None with fewer than two."""
        ran = [r.losses for r in self.results if r.ok]
        if len(ran) < 2:
            return None
        steps = min(len(losses) for losses in ran)
        return max(max(losses[i] for losses in ran) - min(losses[i] for losses in ran) for i in range(steps))

    def table(self) -> str:
        """The side-by-side table, then what ``auto`` planned, then how the figures were taken."""
        base = self.baseline()
        header = ("setting", "policy", "peak GiB", "x none", "median step s", "x none", "tokens/s", "step TFLOP",
                  "x none")
        rows: list[tuple[str, ...]] = []
        for r in self.results:
            if not r.ok:
                rows.append((r.label, r.policy_text or "-", "-", "-", "-", "-", "-", "-", "-"))
                continue
            rows.append((r.label, r.policy_text, f"{r.peak / GIB:.3f}", _ratio(r.peak, base and base.peak),
                         f"{r.median_step_s:.4f}", _ratio(r.median_step_s, base and base.median_step_s),
                         f"{r.tokens_per_s:.0f}", f"{r.step_flops / 1e12:.4g}",
                         _ratio(r.step_flops, base and base.step_flops)))
        rounds = f" in each of {self.rounds} rounds" if self.rounds > 1 else ""
        lines = [f"{self.recipe}: {self.steps} steps per setting{rounds} on {self.device} (torch "
                 f"{self.torch_version}); medians and peaks over steps {self.warmup + 1}-{self.steps} (the first "
                 f"{self.warmup} warm-up)",
                 *_columns([header, *rows])]
        for r in self.results:
            if r.plan is not None:
                lines.append(_plan_line(r, base))
            if r.error:
                lines.append(f"{r.label}: {r.error}")
        difference = self.loss_difference()
        if difference is not None:
            lines.append(f"losses: largest difference between settings at any step {difference:.3g} (the same "
                         "gradients under every policy)")
        source = next((r.memory_source for r in self.results if r.memory_source), "")
        if source:
            lines.append(f"memory: {_SOURCES.get(source, source)}; step FLOPs counted on the first step by torch's "
                         "FLOP counter (matmuls and attention)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the run's context and every setting."""
        return {"recipe": self.recipe, "device": self.device, "target": self.target,
                "torch_version": self.torch_version, "steps": self.steps, "rounds": self.rounds, "warmup_steps": self.warmup,
                "loss_difference": self.loss_difference(), "settings": [r.to_dict() for r in self.results]}

    def plot(self, path: str | Path) -> Path:
        """A PNG of peak memory against median step time, one labelled point per setting, ``auto``'s budgets as
        dashed lines."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        from remat.planner.report import save_figure

        fig, ax = plt.subplots(figsize=(8, 5))
        for index, r in enumerate(r for r in self.results if r.ok):
            color = f"C{index % 10}"
            ax.scatter([r.median_step_s], [r.peak / GIB], color=color, marker="*" if r.plan else "o",
                       s=160 if r.plan else 50, zorder=3)
            ax.annotate(r.label, (r.median_step_s, r.peak / GIB), textcoords="offset points", xytext=(6, 4),
                        fontsize=8)
            if r.plan is not None:
                ax.axhline(r.plan.budget_bytes / GIB, color=color, linestyle="--", linewidth=0.8,
                           label=f"budget of {r.label}")
        ax.set_xlabel(f"median step time (s), steps {self.warmup + 1}-{self.steps}")
        ax.set_ylabel("peak memory (GiB)")
        ax.set_title(f"remat profile: {Path(self.recipe).name} on {self.device}", fontsize=10)
        if any(r.plan is not None for r in self.results):
            ax.legend(fontsize=8)
        return save_figure(fig, ax, path)


_SOURCES = {
    "cuda": "CUDA allocator peak per step (max_memory_allocated, reset before each step)",
    "tracked": "exact peak of live tensor bytes per step (remat's tracker: parameters, gradients, optimizer state, "
               "activations); the tracker's per-op bookkeeping is in every setting's step time",
}


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.3f}" if base else "-"


def _plan_line(r: SettingResult, base: SettingResult | None) -> str:
    assert r.plan is not None
    p = r.plan
    text = (f"{r.label}: planned for {p.budget_bytes / GIB:.3f} GiB: {p.policy}; predicted peak "
            f"{p.predicted_peak_bytes / GIB:.3f} GiB")
    if r.ok:
        text += f" (measured {r.peak / GIB:.3f})"
    text += f", predicted recompute {p.predicted_recompute_flops / 1e12:.4g} TFLOP"
    if r.ok and base is not None:
        text += f" (counted {(r.step_flops - base.step_flops) / 1e12:.4g})"
    return text
