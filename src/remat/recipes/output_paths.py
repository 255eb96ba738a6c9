"""Where a run writes (``output_dir``, ``checkpoint.checkpoint_dir``, ``logging.metrics_file``), checked before
anything is built or created, so that a path under a regular file, a missing permission or a read-only file system
is one line naming the key, not a traceback after the model has been loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from remat.errors import ConfigError


@dataclass(frozen=True)
class OutputPaths:
    """The directories and files a run writes, resolved from its recipe."""

    output_dir: Path
    checkpoint_dir: Path | None
    metrics_file: Path | None

    @classmethod
    def of(cls, output_dir: str, checkpoint_dir: str | None, checkpoints_enabled: bool,
           metrics_file: str | None) -> OutputPaths:
        root = Path(output_dir)
        return cls(output_dir=root,
                   checkpoint_dir=Path(checkpoint_dir or root / "checkpoints") if checkpoints_enabled else None,
                   metrics_file=root / metrics_file if metrics_file else None)

    def check(self) -> None:
        """ConfigError naming the key when a path cannot be written; creates nothing (a refused run leaves no trace:
        the directories are made when the run first writes to them)."""
        check_writable_dir(self.output_dir, "output_dir")
        if self.checkpoint_dir is not None:
            check_writable_dir(self.checkpoint_dir, "checkpoint.checkpoint_dir")
        if self.metrics_file is not None:
            check_writable_dir(self.metrics_file.parent, "logging.metrics_file")
            if self.metrics_file.exists() and not self.metrics_file.is_file():
                raise ConfigError(f"logging.metrics_file: {str(self.metrics_file)!r} exists and is not a file; "
                                  "give a file name (metrics are appended to it as JSON lines)")


def check_writable_dir(path: Path, key: str) -> None:
    """Whether ``path`` is, or can be made as, a directory this process writes to: every existing part of it is a
    directory, and the deepest existing one is writable (on a writable file system); one ConfigError naming ``key``."""
    existing = next(p for p in (path, *path.parents) if p.exists() or p == Path(p.anchor or "."))
    if not existing.is_dir():
        what = "is" if existing == path else "is under"
        raise ConfigError(f"{key}: {str(path)!r} {what} the regular file {str(existing)!r}, not a directory; "
                          "give a directory path (it is created if missing)")
    if os.access(existing, os.W_OK | os.X_OK):
        return
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise ConfigError(f"{key}: cannot write to {str(path)!r}: the file system is read-only; give a directory on a "
                          "writable one")
    raise ConfigError(f"{key}: cannot write to {str(path)!r}: permission denied on {str(existing)!r}; give a directory "
                      "you can write to")
