"""The checkpointing tests' fixture: one intra-op thread (shared helpers: ckpt_models.py, imported as a module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def single_thread() -> Iterator[None]:
    """Tiny models run faster on one intra-op thread (and much faster on a loaded machine): every module of this
    folder runs on one, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
