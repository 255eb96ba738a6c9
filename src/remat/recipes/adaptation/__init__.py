"""Run-time adaptation of ``activation_checkpointing: auto``, the training loop's side: `retry.StepRetry` watches
each step against the budget and retries it under a new plan; `relax_watch.RelaxWatch` counts stable steps before
a plan may be relaxed. The planning comes in through the `retry.Replanner` protocol (`remat.planner.adapt`, above the
recipe, implements it)."""
