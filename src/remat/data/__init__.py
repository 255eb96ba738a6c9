"""The data pipeline: tokenizers, JSONL / local HF datasets / the builtin corpus, masking, packing, batching."""

from __future__ import annotations

from remat.data.config import DatasetConfig, TokenizerConfig
from remat.data.dataset import TokenizedDataset, build_dataset
from remat.data.loader import StatefulBatchIterator
from remat.data.packing import IGNORE_INDEX
from remat.data.tokenizer import build_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "DatasetConfig",
    "StatefulBatchIterator",
    "TokenizedDataset",
    "TokenizerConfig",
    "build_dataset",
    "build_tokenizer",
]
