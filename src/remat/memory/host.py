"""Host memory available to a run: what the kernel says can still be allocated without swapping.

`available_host_bytes` reads ``psutil.virtual_memory().available`` when psutil is installed, else ``MemAvailable``
in /proc/meminfo (the same figure: free memory plus what the page cache and reclaimable slabs can give back).
Pinned (page-locked) host buffers, which activation offload uses on a GPU, come out of this same memory.
"""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")


def available_host_bytes() -> int | None:
    """Bytes of host memory available now, or None where neither psutil nor /proc/meminfo can say."""
    try:
        import psutil
    except ImportError:
        return meminfo_available()
    return int(psutil.virtual_memory().available)


def meminfo_available(path: Path = MEMINFO) -> int | None:
    """``MemAvailable`` from ``path`` (a /proc/meminfo) in bytes; None when the file or the line is missing."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            fields = line.split()
            return int(fields[1]) * (1024 if fields[2:] == ["kB"] else 1)
    return None
