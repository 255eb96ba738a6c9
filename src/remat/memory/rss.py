"""The process's peak resident set size, per step where Linux allows resetting it.

Linux keeps the peak RSS ("high water mark", `VmHWM` in /proc/self/status); writing "5" to /proc/self/clear_refs
resets it to the current RSS. Where that is not possible, the fallback is `resource.getrusage`'s `ru_maxrss`,
which is the peak over the whole life of the process.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS; False if this system does not allow it."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return read_vm_hwm() is not None


def read_vm_hwm() -> int | None:
    """Peak RSS in bytes since the last reset (`VmHWM`), or None where /proc/self/status has no such line."""
    try:
        status = _STATUS.read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                return None
            return int(value) * 1024
    return None


def lifetime_peak_rss() -> int:
    """Peak RSS in bytes over the whole life of this process (`getrusage`; kB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
