"""What `remat plan` prints and writes: the measured block costs, the frontier of uniform policies, one plan per
budget, as text, JSON and a PNG of predicted peak against predicted recompute."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat.planner.measure import BlockMeasurements
from remat.planner.planner import Planner
from remat.planner.result import GIB, ActivationPlan, Candidate, candidate_rows
from remat.units import format_bytes


@dataclass(frozen=True)
class BudgetAnswer:
    """One budget's outcome: a plan, or why nothing fits."""

    budget_bytes: int
    plan: ActivationPlan | None
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the plan's mapping, or the budget and the error."""
        if self.plan is not None:
            return self.plan.to_dict()
        return {"budget_bytes": self.budget_bytes, "budget_gib": round(self.budget_bytes / GIB, 3),
                "error": self.error}


def measurements_dict(m: BlockMeasurements) -> dict[str, Any]:
    """JSON-ready block measurements: per kind, the blocks and each mode's kept bytes and recompute FLOPs."""
    return {
        "num_blocks": m.num_blocks,
        "step_flops_per_micro_batch": m.step_flops,
        "seconds": round(m.seconds, 3),
        "kinds": [{"name": kind.name, "blocks": list(kind.indices), "flops": kind.flops,
                   "modes": {c.mode: {"kept_bytes": c.kept_bytes, "recompute_flops": c.recompute_flops,
                                      "backward_peak_bytes": c.backward_peak_bytes} for c in kind.costs}}
                  for kind in m.kinds],
    }


def report_dict(planner: Planner, frontier: Sequence[Candidate], answers: Sequence[BudgetAnswer]) -> dict[str, Any]:
    """The whole `remat plan` answer as one JSON-ready mapping."""
    return {
        "model": planner.recipe.model.describe(),
        "target": planner.run.target,
        "flops_per_second": planner.flops_per_second,
        "rates_per_second": planner.rates.to_dict(),
        "measurements": measurements_dict(planner.measurements),
        "frontier": [candidate.to_dict() for candidate in frontier],
        "budgets": [answer.to_dict() for answer in answers],
    }


def report_text(planner: Planner, frontier: Sequence[Candidate], answers: Sequence[BudgetAnswer]) -> str:
    """The `remat plan` printout: the frontier, then per budget the plan (or why nothing fits)."""
    m = planner.measurements
    lines = [f"{planner.describe()}; {m.num_blocks} blocks of {len(m.kinds)} kind(s) measured in {m.seconds:.1f} s",
             ""]
    if frontier:
        lines += ["frontier: uniform policies (peak by the estimate, recompute per step):",
                  *candidate_rows(frontier, planner.step_flops, fits=False,
                                  flops_per_second=planner.rates.flops_per_second)]
    else:
        lines.append("frontier: not priced (no budget reaches the smallest plan's peak; each budget says what it needs)")
    for answer in answers:
        lines += ["", f"budget {format_bytes(answer.budget_bytes)}:"]
        if answer.plan is None:
            lines.append(f"  nothing fits: {answer.error}")
            continue
        lines += ["  " + line for line in answer.plan.table(candidates=False).splitlines()]
        tried = [c for c in answer.plan.candidates if not c.uniform]
        if tried:
            lines.append("  plans priced by the estimate for this budget:")
            lines += ["  " + row for row in candidate_rows(tried, answer.plan.step_flops, chosen=answer.plan.policy,
                                                           flops_per_second=answer.plan.flops_per_second)]
    return "\n".join(lines)


def plot_plans(frontier: Sequence[Candidate], answers: Sequence[BudgetAnswer], path: str | Path, *,
               step_flops: int) -> Path:
    """A PNG of predicted peak (GiB) against predicted recompute (% of the step): the uniform policies labelled,
    every plan the planner priced in grey, the chosen plan of each budget as a star on its budget line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def x(candidate: Candidate) -> float:
        return 100 * candidate.recompute_flops / step_flops if step_flops else 0.0

    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([x(c) for c in frontier], [c.peak_bytes / GIB for c in frontier], color="tab:blue",
               label="uniform policies", zorder=3)
    for c in frontier:
        ax.annotate(c.label, (x(c), c.peak_bytes / GIB), textcoords="offset points", xytext=(5, 4), fontsize=8)
    tried = [c for a in answers if a.plan is not None for c in a.plan.candidates if not c.uniform]
    if tried:
        ax.scatter([x(c) for c in tried], [c.peak_bytes / GIB for c in tried], color="0.6", s=14,
                   label="plans priced", zorder=2)
    for index, answer in enumerate(answers):
        color = f"C{(index + 1) % 10}"
        ax.axhline(answer.budget_bytes / GIB, color=color, linestyle="--", linewidth=0.8)
        if answer.plan is not None:
            chosen = next(c for c in answer.plan.candidates if c.policy == answer.plan.policy)
            ax.scatter([x(chosen)], [chosen.peak_bytes / GIB], marker="*", s=180, color=color, zorder=4,
                       label=f"chosen for {format_bytes(answer.budget_bytes)}")
    ax.set_xlabel("predicted recompute (% of the step's FLOPs)")
    ax.set_ylabel("predicted peak (GiB)")
    ax.set_title("remat plan: memory against recompute")
    ax.legend(fontsize=8, loc="upper right")
    return save_figure(fig, ax, path)


def save_figure(fig: Any, ax: Any, path: str | Path) -> Path:
    """Grid ``ax``, write ``fig`` as a PNG at ``path`` (folders made as needed) and close it."""
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
