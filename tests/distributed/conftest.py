"""The distributed tests' fixture: one tokenizer cache for the folder (helpers to launch workers: launches.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def remat_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tokenizer cache shared by the test process and its workers (the builtin BPE is trained once)."""
    cache = tmp_path_factory.mktemp("remat-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REMAT_CACHE_DIR", str(cache))
        yield cache
