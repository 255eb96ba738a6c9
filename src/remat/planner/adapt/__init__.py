"""Run-time adaptation of ``activation_checkpointing: auto``, the planner's side: `adapter.PlanAdapter` re-plans
from what a step measured (an overshoot, an out-of-memory error, a stable stretch well under the budget), in a child
process when the worker holds a process group (one typed message each way), and `relaxing` chooses the plan a
stable stretch allows.

The training loop's side is `remat.recipes.adaptation` (it watches each step and asks through the small
`Replanner` protocol, since the recipe sits below the planner); the out-of-memory notes that carry a re-plan across
torchrun restarts are saved state (`remat.training_state.oom_notes`).
"""
