"""The builtin corpus: the English help topics that ship with every CPython (`pydoc_data.topics`).

Each topic is one document (topics that share their text, such as "if" and "else", count once, under the first key
in sorted order). Documents are split ~95/5 into "train" and "validation" by a stable hash of that topic key, so the
split is the same on every machine and every run (the text itself follows the Python version).
"""

from __future__ import annotations

import hashlib
from pydoc_data.topics import topics as _TOPICS

from remat.errors import ConfigError

BUILTIN_SPLITS = ("train", "validation")
_VALIDATION_PERCENT = 5


def _split_of(key: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % 100
    return "validation" if bucket < _VALIDATION_PERCENT else "train"


def builtin_documents(split: str = "train", *, key: str = "dataset.split") -> list[str]:
    """The builtin corpus documents of `split` ("train" or "validation"), in sorted topic-key order."""
    if split not in BUILTIN_SPLITS:
        raise ConfigError(f"{key}: the builtin corpus has splits {list(BUILTIN_SPLITS)}; got {split!r}")
    return [text for name, text in _unique_topics() if _split_of(name) == split]


def _unique_topics() -> list[tuple[str, str]]:
    seen: set[str] = set()
    unique = []
    for name in sorted(_TOPICS):
        if _TOPICS[name] not in seen:
            seen.add(_TOPICS[name])
            unique.append((name, _TOPICS[name]))
    return unique


def builtin_corpus_fingerprint() -> str:
    """A hex digest of the corpus as served: each document's key, split and text (follows the Python version)."""
    digest = hashlib.sha256()
    for name, text in _unique_topics():
        digest.update(f"{name}\0{_split_of(name)}\0{text}\0".encode())
    return digest.hexdigest()
