"""The names of the checkpoint directory protocol that code without torch needs (the run's output paths)."""

from __future__ import annotations

#: File names of the out-of-memory notes a rank of several leaves for the restarted run (`remat.adaptation.oom_notes`):
#: ``oom-replan-rank<R>.json``; a restart moves them aside with the checkpoints.
NOTE_PREFIX = "oom-replan-rank"
#: The pointer file naming a checkpoint directory's newest complete step (written atomically, never through a link).
LATEST_FILE = "latest"
