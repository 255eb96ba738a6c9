"""Opening the files of a run as data, never as something else: only regular files are read (a FIFO, a device or a
directory in a file's place is one line, not a hang), writes into a directory the run owns never follow a symbolic
link planted there nor in place into a file with a second name (a hard link), and a full disk is one line naming
the path and the bytes.

# NOTE [ Why not just ``open`` ]
# ``open(path)`` on a FIFO blocks until a writer appears, on ``/dev/zero`` it reads forever, and ``open(path, "w")``
# on a planted link overwrites whatever the link names. Opening with ``O_NONBLOCK`` returns at once for a FIFO, and
# ``fstat`` of the opened descriptor (not ``stat`` of the name, which could change in between) says what it is.
# Writes go to a fresh temporary name opened with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and are renamed over the target;
# ``rename`` replaces a link itself, never what it points to, and the link is reported before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path
from typing import IO

from remat.errors import ConfigError, MachineFault
from remat.units import format_bytes

#: How torch's zip writer and safetensors say ENOSPC when they do not raise an OSError.
_DISK_FULL_TEXTS = ("No space left on device", "os error 28", "PytorchStreamWriter failed writing file")
#: torch's zip writer finding its file shorter than it wrote (the disk filled inside ``torch.save``): all signs at once.
_SHORT_WRITE_TEXTS = ("inline_container.cc", "unexpected pos")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def kind_of(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular_file(path: str | os.PathLike[str], what: str, *, follow_symlinks: bool = True) -> Path:
    """`path` when it is a regular file (through links when `follow_symlinks`); ConfigError naming `what`
    otherwise. For paths handed to a library that opens them itself (torch.load, safetensors)."""
    path = Path(path)
    try:
        mode = (path.stat() if follow_symlinks else path.lstat()).st_mode
    except OSError as err:
        raise ConfigError(f"{what} {shown(path)}: {_reason(err)}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{what} {shown(path)} is {kind_of(mode)}; allowed: a regular file")
    return path


def open_regular(path: str | os.PathLike[str], what: str, *, follow_symlinks: bool = True) -> IO[bytes]:
    """`path` opened for reading when it is a regular file; ConfigError naming `what` when it is a FIFO, a device
    or a directory (never blocks on one), missing or unreadable."""
    path = Path(path)
    flags = os.O_RDONLY | _NONBLOCK | (0 if follow_symlinks else _NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        if err.errno == errno.ELOOP and not follow_symlinks:
            raise ConfigError(f"{what} {shown(path)} is a symbolic link; allowed: a regular file") from None
        raise ConfigError(f"{what} {shown(path)} cannot be read: {_reason(err)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{what} {shown(path)} is {kind_of(info.st_mode)}; allowed: a regular file")
        if _NONBLOCK:
            os.set_blocking(fd, True)
        return open(fd, "rb", closefd=True)  # noqa: SIM115 (the caller closes it)
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | os.PathLike[str], what: str, *, limit: int | None = None,
                       follow_symlinks: bool = True) -> bytes:
    """The bytes of the regular file `path`; ConfigError naming `what` and the limit when it holds more than
    `limit` bytes (checked on the open file, before reading)."""
    with open_regular(path, what, follow_symlinks=follow_symlinks) as handle:
        if limit is not None:
            size = os.fstat(handle.fileno()).st_size
            if size > limit:
                raise ConfigError(f"{what} {shown(path)} holds {size:,} bytes; allowed: at most {limit:,}")
        data = handle.read() if limit is None else handle.read(limit + 1)
    if limit is not None and len(data) > limit:  # grew while it was read
        raise ConfigError(f"{what} {shown(path)} holds more than {limit:,} bytes; allowed: at most {limit:,}")
    return data  # type: ignore[no-any-return]


def refuse_link(path: str | os.PathLike[str], what: str) -> None:
    """ConfigError when `path` is a symbolic link: a file the run writes in its own directory is never written
    through a link (someone could have planted it to make the run overwrite another file)."""
    path = Path(path)
    if path.is_symlink():
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise ConfigError(f"{what} {shown(path)} is a symbolic link (to {shown(target)}); remat does not "
                          "write through links in a directory it owns: remove the link, or use another output_dir")


def refuse_hard_link(path: str | os.PathLike[str], what: str, info: os.stat_result | None = None) -> None:
    """ConfigError when the regular file at `path` has more than one name: appending to it (or writing it in place)
    would change the file under its other name too, which may lie outside the run. (`write_atomic` needs no such
    check: it renames a new file over the name, and the other name keeps the old content.)"""
    if info is None:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return
    if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        raise ConfigError(f"{what} {shown(path)} has {info.st_nlink} names (hard links); remat never writes in place "
                          "a file that another name shares: remove it (or copy it to a file of its own), or use "
                          "another output_dir")


def write_atomic(path: str | os.PathLike[str], data: bytes | str, what: str, *, durable: bool = True) -> None:
    """Replace `path` with `data` in one step (a temporary file in the same directory, renamed over it): readers see
    the old or the new content, never half; a link at `path` is refused (`refuse_link`), never followed; a full
    disk is one ConfigError naming the path (`disk_full_error`)."""
    path = Path(path)
    refuse_link(path, what)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover of this pid (or a planted name): never written through
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise disk_full_error(err, path, len(payload)) if err.errno == errno.ENOSPC else err from None
    if durable:
        fsync_path(path.parent)


def open_append(path: str | os.PathLike[str], what: str, *, read: bool = False, encoding: str = "utf-8") -> IO[str]:
    """`path` opened for appending text (and reading, with `read`: mode ``a+``), created if missing; ConfigError
    when it is a link or not a regular file."""
    path = Path(path)
    refuse_link(path, what)
    access = os.O_RDWR if read else os.O_WRONLY
    try:
        fd = os.open(path, access | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            refuse_link(path, what)
        raise ConfigError(f"{what} {shown(path)}: {_reason(err)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{what} {shown(path)} is {kind_of(info.st_mode)}; allowed: a regular file")
        refuse_hard_link(path, what, info)
        os.set_blocking(fd, True)
        return open(fd, "a+" if read else "a", encoding=encoding, closefd=True)  # noqa: SIM115 (the caller closes it)
    except BaseException:
        os.close(fd)
        raise


def fsync_path(path: Path) -> None:
    """Flush a file or a directory entry to disk (a no-op where directories cannot be opened for it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def disk_full_error(err: BaseException, path: str | os.PathLike[str], needed: int | None = None) -> MachineFault:
    """One line for a write that found no space: the path, the bytes it needed (when known) and what is free."""
    path = Path(path)
    free = None
    for parent in (path, *path.parents):
        try:
            free = shutil.disk_usage(parent).free
            break
        except OSError:
            continue
    need = f" needs {format_bytes(needed)}," if needed else ""
    left = f" {format_bytes(free)} free" if free is not None else ""
    return MachineFault(f"no space left on the device holding {shown(path)}:{need}{left}; free some space or "
                        "write elsewhere (output_dir, checkpoint.checkpoint_dir); earlier checkpoints are kept")


def is_disk_full(err: BaseException) -> bool:
    """Whether `err`, or an error it was raised from, says the device is full (ENOSPC, or the text of torch's and
    safetensors' own wrappers of it, which carry no errno)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        text = str(current)
        if any(sign in text for sign in _DISK_FULL_TEXTS) or all(sign in text for sign in _SHORT_WRITE_TEXTS):
            return True
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint: what each rank raised
        if isinstance(failures, dict) and any(is_disk_full(f[0]) for f in failures.values()
                                              if isinstance(f, tuple) and f and isinstance(f[0], BaseException)):
            return True
        current = current.__cause__ or current.__context__
    return False


def printable(text: str, limit: int = 200) -> str:
    """`text` safe to echo on a terminal: control characters (escape sequences included) shown as escapes."""
    shown = text.encode("unicode_escape", "backslashreplace").decode("ascii") if not text.isprintable() else text
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def shown(text: str | os.PathLike[str], limit: int = 200) -> str:
    """`text` quoted for a message, as ``repr`` quotes it, with control characters escaped once (never raw)."""
    text = os.fspath(text)
    return repr(text) if text.isprintable() and len(text) <= limit else f"'{printable(text, limit)}'"


def _reason(err: OSError) -> str:
    return err.strerror or type(err).__name__


__all__ = ["check_regular_file", "disk_full_error", "fsync_path", "is_disk_full", "kind_of", "open_append",
           "open_regular", "printable", "read_regular_bytes", "refuse_link", "shown", "write_atomic"]
