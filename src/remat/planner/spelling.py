"""How the planner's errors name the settings that would help: in the words of the caller who asked.

A recipe's user reads recipe keys (``step_scheduler.local_batch_size``), a Python caller of
`remat.plan_activation_checkpointing` the keyword arguments it passed (``batch_size=``), a Trainer's user the
``TrainingArguments`` and `remat.prepare_trainer` arguments. The planner holds one `Spelling`; each entry point
passes its own.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PYTHON", "RECIPE", "TRAINER", "Spelling"]


@dataclass(frozen=True)
class Spelling:
    """The phrases of "nothing fits ... What would help: ...". ``batch`` and ``seq_length`` take ``{now}``,
    ``more_ranks`` takes ``{ranks}``."""

    budget: str
    batch: str
    fsdp: str
    more_ranks: str
    fused_loss: str
    seq_length: str


RECIPE = Spelling(
    budget="distributed.activation_checkpointing.memory_budget",
    batch="a smaller micro-batch (step_scheduler.local_batch_size, now {now})",
    fsdp="FSDP (distributed.strategy: fsdp2 shards parameters, gradients and optimizer state over the ranks)",
    more_ranks="more FSDP ranks (now {ranks})",
    fused_loss="the fused loss (loss_fn._target_: remat.loss.FusedLinearCrossEntropy never holds the logits)",
    seq_length="shorter sequences (dataset.seq_length, now {now})",
)

PYTHON = Spelling(
    budget="memory_budget",
    batch="a smaller micro-batch (batch_size=, now {now})",
    fsdp="FSDP (strategy='fsdp2' with world_size= ranks shards parameters, gradients and optimizer state)",
    more_ranks="more FSDP ranks (world_size=, now {ranks})",
    fused_loss="the fused loss (loss='fused' never holds the logits)",
    seq_length="shorter sequences (seq_length=, now {now})",
)

TRAINER = Spelling(
    budget="memory_budget",
    batch="a smaller micro-batch (TrainingArguments.per_device_train_batch_size, now {now}, with more "
          "gradient_accumulation_steps for the same global batch)",
    fsdp="FSDP2 over several processes (TrainingArguments.fsdp with fsdp_version 2, under torchrun or accelerate "
         "launch) shards parameters, gradients and optimizer state",
    more_ranks="more FSDP processes (now {ranks})",
    fused_loss="the fused loss (prepare_trainer(..., loss='fused') never holds the logits)",
    seq_length="shorter rows (seq_length= or the trainer's max_length, now {now})",
)
