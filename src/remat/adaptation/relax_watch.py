"""Relaxing ``activation_checkpointing: auto`` at run time: after a stable stretch of steps whose measured peaks
stay well under the memory budget, ask the replanner for a plan with less recompute, and swap it in when one is
predicted faster and, corrected by what the stretch measured, to fit with a margin.

The counterpart of `remat.adaptation.retry` (which tightens a plan when a step goes over); `StepRetry` runs both.

- **The stretch**: ``activation_checkpointing.relax_after_steps`` consecutive steps under the plan in force whose agreed
  forward+backward peak (the over-budget watch's reading, the maximum over the ranks) stays at or below
  ``(1 - RELAX_MARGIN) x budget``. A step above that starts the stretch over. The first optimizer update (no
  optimizer state yet, so a lower peak than later steps) is not counted.
- **One question per plan**: at the end of a stretch the replanner is asked once (`Replanner.relax`; rank 0 plans
  and broadcasts its answer, as for a re-plan); whatever it answers, the same plan is not asked about again. A
  relaxed plan gets a stretch of its own and may be relaxed further: each relax lowers the predicted recompute time,
  so relaxes are finitely many.
- **No oscillation**: when a relaxed plan goes over the budget, the re-plan path catches it (the step is retried;
  that re-plan counts against ``activation_checkpointing.max_replans``, the relax itself does not) and relaxing stops for the
  rest of the run. The replanner also never relaxes to a plan predicted to keep as much as one that went over.
- **Resumable**: the stretch, the relaxes and whether relaxing stopped are saved in ``train_state.json`` (with the
  replanner's state, which holds the plan in force), so a resumed run takes the same decisions at the same steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

RELAX_MARGIN: Final[float] = 0.05
"""The stretch's peaks must stay at least this share under the budget, and a relaxed plan's corrected prediction
must fit ``(1 - RELAX_MARGIN) x budget``: room for a step that peaks a little higher than the stretch did."""


@dataclass(frozen=True)
class Stretch:
    """What a stable stretch measured: ``steps`` steps ending at step ``step`` (1 = the first), whose highest
    forward+backward peak (max over ranks) was ``peak_bytes``, under ``budget_bytes``; a relaxed plan must fit
    ``(1 - margin) x budget_bytes`` once corrected."""

    step: int
    steps: int
    peak_bytes: int
    budget_bytes: int
    margin: float = RELAX_MARGIN

    @property
    def target_bytes(self) -> int:
        """What a relaxed plan's corrected forward+backward peak must stay within."""
        return int(self.budget_bytes * (1 - self.margin))


class RelaxWatch:
    """Counts the stable stretch and decides when to ask for a relaxed plan (module docstring).

    ``after_steps``: the stretch's length (``activation_checkpointing.relax_after_steps``; None: never relax). ``ask`` gets the
    `Stretch` and returns True when it swapped in a relaxed plan (`StepRetry` asks the replanner on every rank
    together and logs).
    """

    def __init__(self, after_steps: int | None, ask: Callable[[Stretch], bool]) -> None:
        self.after_steps = after_steps
        self._ask = ask
        self.relaxes = 0
        self.stopped = False
        self.steps = 0
        self.peak_bytes = 0
        self.asked = False
        self.relaxed_in_force = False

    def after_step(self, step: int, peak_bytes: int | None, budget_bytes: int, *, first_update: bool) -> None:
        """Step ``step`` finished with forward+backward ``peak_bytes`` (agreed over the ranks; None when not read):
        count it into the stretch, and at the stretch's end ask once."""
        if self.after_steps is None or self.stopped or self.asked or first_update or peak_bytes is None:
            return
        if peak_bytes > budget_bytes * (1 - RELAX_MARGIN):
            self.steps, self.peak_bytes = 0, 0
            return
        self.steps += 1
        self.peak_bytes = max(self.peak_bytes, peak_bytes)
        if self.steps < self.after_steps:
            return
        self.asked = True
        if self._ask(Stretch(step=step, steps=self.steps, peak_bytes=self.peak_bytes, budget_bytes=budget_bytes)):
            self.relaxes += 1
            self.relaxed_in_force = True
            self._new_plan()

    def after_replan(self) -> bool:
        """A step went over and was re-planned: a relaxed plan that went over stops relaxing for good (returns True
        then); any new plan starts a new stretch."""
        stops = self.relaxed_in_force and not self.stopped
        self.stopped = self.stopped or self.relaxed_in_force
        self.relaxed_in_force = False
        self._new_plan()
        return stops

    def _new_plan(self) -> None:
        self.steps, self.peak_bytes, self.asked = 0, 0, False

    def state_dict(self) -> dict[str, Any]:
        """For ``train_state.json`` (JSON types)."""
        return {"relaxes": self.relaxes, "stopped": self.stopped, "steps": self.steps, "peak_bytes": self.peak_bytes,
                "asked": self.asked, "relaxed_in_force": self.relaxed_in_force}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue a saved run's stretch and decisions."""
        self.relaxes = int(state.get("relaxes", 0))
        self.stopped = bool(state.get("stopped", False))
        self.steps = int(state.get("steps", 0))
        self.peak_bytes = int(state.get("peak_bytes", 0))
        self.asked = bool(state.get("asked", False))
        self.relaxed_in_force = bool(state.get("relaxed_in_force", False))
