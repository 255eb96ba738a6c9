"""Host memory available to a run: psutil's figure or /proc/meminfo's MemAvailable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from remat.memory.host import available_host_bytes, meminfo_available


def test_meminfo_available_reads_the_line_in_bytes(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:   12345678 kB\n")
    assert meminfo_available(meminfo) == 12345678 * 1024
    meminfo.write_text("MemTotal:       32000000 kB\n")
    assert meminfo_available(meminfo) is None
    assert meminfo_available(tmp_path / "missing") is None


def test_without_psutil_the_figure_comes_from_proc_meminfo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now raises ImportError
    assert available_host_bytes() == meminfo_available()
    if Path("/proc/meminfo").is_file():
        assert available_host_bytes() > 0
