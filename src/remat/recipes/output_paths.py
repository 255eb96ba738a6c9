"""Where a run writes (``output_dir``, ``checkpoint.checkpoint_dir``, ``logging.metrics_file``), checked and created
before anything is built, so that a path under a regular file, a missing permission or a read-only file system is
one line naming the key, not a traceback after the model has been loaded."""

from __future__ import annotations

import errno
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

    def prepare(self) -> None:
        """Create the directories (parents included); ConfigError naming the key when one cannot be written."""
        make_writable_dir(self.output_dir, "output_dir")
        if self.checkpoint_dir is not None:
            make_writable_dir(self.checkpoint_dir, "checkpoint.checkpoint_dir")
        if self.metrics_file is not None:
            make_writable_dir(self.metrics_file.parent, "logging.metrics_file")
            if self.metrics_file.exists() and not self.metrics_file.is_file():
                raise ConfigError(f"logging.metrics_file: {str(self.metrics_file)!r} exists and is not a file; "
                                  "give a file name (metrics are appended to it as JSON lines)")


def make_writable_dir(path: Path, key: str) -> None:
    """``mkdir -p path`` and check that this process may write there; one ConfigError line naming ``key``."""
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        what = "is" if blocker == path else "is under"
        raise ConfigError(f"{key}: {str(path)!r} {what} the regular file {str(blocker)!r}, not a directory; "
                          "give a directory path (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{key}: cannot create {str(path)!r}: {_reason(err)}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {str(path)!r} is not writable by this user; give a directory you can write to")


def _reason(err: OSError) -> str:
    if err.errno == errno.EROFS:
        return "the file system is read-only; give a directory on a writable one"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "permission denied; give a directory you can write to"
    if err.errno == errno.ENOSPC:
        return "no space left on the device"
    return err.strerror or str(err)
