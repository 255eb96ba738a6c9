"""Where a run writes (``output_dir``, ``checkpoint.checkpoint_dir``, ``logging.metrics_file``), checked before
anything is built or created, so that a path under a regular file, a missing permission or a read-only file system
is one line naming the key, not a traceback after the model has been loaded."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from remat._files import kind_of, refuse_hard_link, refuse_link, shown
from remat.errors import ConfigError
from remat.training_state.names import LATEST_FILE

#: The files a run owns in its directories, besides the checkpoints themselves (written where named, never through a
#: link planted there: `remat._files`).
LOCK_FILE = ".remat.lock"
REPORT_FILE = "report.png"
WANDB_ID_FILE = "wandb_run_id"
PLAN_FILE = "auto_plan.json"
HOST_MEMORY_FILE = "host_memory.json"
#: The longest name of one path component on the file systems remat runs on (ext4, xfs, btrfs, NFS: 255 bytes).
MAX_NAME_BYTES = 255


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
        """ConfigError naming the key when a path cannot be written, or when a file the run writes there is a
        symbolic link or not a regular file (planted links are never written through); creates nothing (a refused
        run leaves no trace: the directories are made when the run first writes to them)."""
        check_path_text(self.output_dir, "output_dir")
        if self.checkpoint_dir is not None:
            check_path_text(self.checkpoint_dir, "checkpoint.checkpoint_dir")
        if self.metrics_file is not None:
            check_path_text(self.metrics_file, "logging.metrics_file")
        check_writable_dir(self.output_dir, "output_dir")
        if self.checkpoint_dir is not None:
            if self.checkpoint_dir == self.output_dir / "checkpoints" and self.checkpoint_dir.is_symlink():
                raise ConfigError(f"checkpoint.checkpoint_dir {shown(self.checkpoint_dir)} is a symbolic link (to "
                                  f"{shown(os.readlink(self.checkpoint_dir))}) inside output_dir; remat does not write "
                                  "through links in a directory it owns: remove the link, or name the directory you "
                                  "want as checkpoint.checkpoint_dir on the command line")
            check_writable_dir(self.checkpoint_dir, "checkpoint.checkpoint_dir")
        if self.metrics_file is not None:
            check_writable_dir(self.metrics_file.parent, "logging.metrics_file")
            if self.metrics_file.exists() and not self.metrics_file.is_file():
                raise ConfigError(f"logging.metrics_file: {str(self.metrics_file)!r} exists and is not a file; "
                                  "give a file name (metrics are appended to it as JSON lines)")
        for path, what in self.owned_files():
            refuse_link(path, what)
            refuse_hard_link(path, what)
            if path.exists() and not path.is_file():
                raise ConfigError(f"{what} {shown(path)} is {kind_of(path.stat().st_mode)}; remat writes "
                                  "a regular file there: move it away, or use another output_dir")

    def owned_files(self) -> Iterator[tuple[Path, str]]:
        """The files a run writes directly in its directories (not inside checkpoints), with what each is."""
        yield self.output_dir / LOCK_FILE, "run lock"
        yield self.output_dir / REPORT_FILE, "run report"
        yield self.output_dir / WANDB_ID_FILE, "logging.wandb run id file"
        yield self.output_dir / PLAN_FILE, "auto plan file"
        yield self.output_dir / HOST_MEMORY_FILE, "host memory verdict"
        if self.metrics_file is not None:
            yield self.metrics_file, "logging.metrics_file"
        if self.checkpoint_dir is not None:
            yield self.checkpoint_dir / LOCK_FILE, "run lock"
            yield self.checkpoint_dir / LATEST_FILE, "checkpoint pointer"


def check_path_text(path: Path, key: str) -> None:
    """ConfigError naming ``key`` for a path no file system takes (a NUL byte, a part longer than 255 bytes) or one
    that would be echoed to the terminal as a control sequence (an escape, a newline)."""
    text = str(path)
    if "\x00" in text:
        raise ConfigError(f"{key}: {shown(text)} holds a NUL byte, which no path can; allowed: a path without one")
    if not text.isprintable():
        raise ConfigError(f"{key}: {shown(text)} holds control characters (an escape sequence, a newline), which "
                          "every line naming the path would send to the terminal; allowed: printable characters")
    for part in path.parts:
        size = len(os.fsencode(part))
        if size > MAX_NAME_BYTES:
            raise ConfigError(f"{key}: the part {shown(part, 60)} of the path is {size} bytes long; allowed: at "
                              f"most {MAX_NAME_BYTES} bytes per file or directory name")


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


def check_output_file(path: Path, flag: str) -> None:
    """Refuse, before any work, an output file named on the command line (``--json``, ``--png``...) that is a
    directory, lies under a regular file, or cannot be written; missing parent directories are made when it is
    written."""
    check_path_text(path, flag)
    if path.is_dir():
        raise ConfigError(f"{flag}: {shown(path)} is a directory; allowed: a file path (e.g. "
                          f"{shown(path / ('out' + (path.suffix or '.json')))})")
    existing = next(p for p in path.parents if p.exists() or p == Path(p.anchor or "."))
    if not existing.is_dir():
        raise ConfigError(f"{flag}: {shown(path)} is under the regular file {shown(existing)}, not a directory; "
                          "allowed: a path under a directory")
    check_writable_dir(path.parent, flag)
