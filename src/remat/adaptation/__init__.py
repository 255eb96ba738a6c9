"""Run-time adaptation of ``activation_checkpointing: auto``, in one place: the watch of each step against the
budget and its retry under a new plan (`retry.StepRetry`: a whole step in `remat finetune`'s loop;
`trainer.MicroBatchRetry`: one micro-batch in the Hugging Face Trainer's), the re-planning from what a step measured
(`adapter.PlanAdapter`, in a child process when the step needs one: `remat._child`), relaxing a plan after a stable
stretch (`relax_watch` counts, `relaxing` chooses) and the out-of-memory notes that carry a re-plan across torchrun
restarts (`oom_notes`).

The recipe's loop sits below the planner: it asks for its watch through `remat.recipes.finetune.Adaptation`
(``PlanAdapter.guard``), so nothing below this package imports it.
"""
