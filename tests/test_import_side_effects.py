"""`import remat` leaves the process alone (no torch, no environment change); the command line sets
OMP_WAIT_POLICY before torch loads, keeping a value the user set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
PROBE = ("import os, sys; import {module}; "
         "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules, hasattr({module}, '__name__'))")


def _probe(module: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    clean["PYTHONPATH"] = SRC + os.pathsep + clean.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], env={**clean, **env},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_import_remat_loads_nothing_and_sets_nothing() -> None:
    assert _probe("remat") == "None False True"


@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_command_line_sets_a_passive_wait_before_torch_loads(given: str | None, expected: str) -> None:
    env = {"OMP_WAIT_POLICY": given} if given else {}
    assert _probe("remat.cli", **env) == f"{expected} False True"


def test_public_names_resolve_lazily() -> None:
    import remat

    assert remat.estimate_memory.__module__ == "remat.estimate.api"
    assert remat.CheckpointPolicy.__name__ == "CheckpointPolicy"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = remat.nope
