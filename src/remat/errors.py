"""Exceptions that describe a user's mistake (bad config, unsupported model) rather than a bug.

The CLI prints these as one clear message without a traceback; everything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class RematError(Exception):
    """Base class for errors caused by input the user can fix."""


class ConfigError(RematError, ValueError):
    """A recipe or argument is malformed: names the dotted key, what was given and what is allowed."""


class MachineFault(RematError):
    """The machine, not the input, stopped the work (a full disk): one line naming the path and the bytes, exit
    status 1; the last complete checkpoint is kept."""


class CheckpointingError(RematError, ValueError):
    """Activation checkpointing cannot be applied as asked (no blocks found, unknown policy, ...)."""


class TrainingDivergedError(RematError):
    """Training produced NaN or infinite values: a step's loss or gradient norm (the run stops per
    ``training.on_nonfinite``, with that step's update not applied), or weights or optimizer state about to be saved
    or just resumed from. Nothing non-finite is saved."""


class DistributedSetupError(RematError):
    """The process group could not be set up in time: a rank did not arrive or cannot be reached."""


class MemoryBudgetError(RematError):
    """A training step does not fit ``activation_checkpointing.memory_budget`` and re-planning the checkpointing (``auto``) gave
    up: the message says what the last plan needed and what would help."""
