"""The data pipeline: tokenizers, JSONL / local HF datasets / the builtin corpus, masking, packing, batching."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._lazy import lazy_exports

# Imported on first use (remat._lazy), so that light submodules load without torch.
_EXPORTS: dict[str, str] = {
    "StatefulBatchIterator": "remat.data.loader",
    "DatasetConfig": "remat.data.config",
    "TokenizerConfig": "remat.data.config",
    "IGNORE_INDEX": "remat.data.packing",
    "build_dataset": "remat.data.dataset",
    "build_tokenizer": "remat.data.tokenizer",
}

__all__ = [
    "StatefulBatchIterator",
    "IGNORE_INDEX",
    "DatasetConfig",
    "TokenizerConfig",
    "build_dataset",
    "build_tokenizer",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from remat.data.config import DatasetConfig, TokenizerConfig
    from remat.data.dataset import build_dataset
    from remat.data.loader import StatefulBatchIterator
    from remat.data.packing import IGNORE_INDEX
    from remat.data.tokenizer import build_tokenizer
