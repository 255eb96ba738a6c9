"""The names of the checkpoint directory protocol that code without torch needs (the run's output paths)."""

from __future__ import annotations

#: The pointer file naming a checkpoint directory's newest complete step (written atomically, never through a link).
LATEST_FILE = "latest"
