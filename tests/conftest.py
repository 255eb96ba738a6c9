"""Shared test setup, and the device markers.

Tests say which device they mean. CPU expectations pin the CPU (``distributed.device: cpu`` in a recipe,
``device="cpu"`` for ``DistributedSetup.build``, models built on the CPU), so they hold on a machine with GPUs too.
Tests of the CUDA paths carry ``@pytest.mark.gpus(n)`` (n defaults to 1): they run where at least ``n`` CUDA devices
are visible, and are skipped with a reason that names the count otherwise.

Runs are deterministic: property tests draw fixed examples, and no process a test starts may outlive it (a stray
torchrun worker would otherwise wait in a collective long after its test, or hang CI).
"""

import importlib.util
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

# Before torch is imported anywhere in the test session: see the note in remat/cli.py.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402
from processes import PROC, TEST_MARK, reap_leftovers  # noqa: E402

# Property tests draw the same examples on every run (derandomized: chosen from each test's own code), so a red CI run
# is never a new random draw; `pytest --hypothesis-profile explore` draws fresh ones, for looking wider by hand.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile("deterministic")


def visible_gpus() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("gpus")
    if marker is None:
        return
    needed = int(marker.args[0]) if marker.args else 1
    have = visible_gpus()
    if have < needed:
        pytest.skip(f"needs {needed} CUDA device{'s' if needed > 1 else ''}; this machine has {have} "
                    "(torch.cuda.device_count())")


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every process a test starts carries a mark of that test in its environment (torchrun's workers too, which
    run in sessions of their own); one still running after the test (and a grace period) is killed, and the test
    errors naming it, instead of a stray worker hanging CI later."""
    if not PROC.is_dir():
        yield
        return
    mark = uuid.uuid4().hex
    monkeypatch.setenv(TEST_MARK, mark)
    yield
    left = reap_leftovers(mark)
    if left:
        pytest.fail(f"{len(left)} process(es) started by this test were still running after it and were killed: "
                    + "; ".join(f"pid {pid}: {command[:300]}" for pid, command in left.items()), pytrace=False)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def benchmark_script() -> Callable[[str], ModuleType]:
    """Import ``benchmarks/<name>.py`` (the scripts are not a package), so tests can run their short forms."""

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
        return module

    return load
