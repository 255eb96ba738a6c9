"""The builtin corpus and its deterministic train/validation split."""

from __future__ import annotations

from pydoc_data.topics import topics

import pytest

from remat.data.corpus import builtin_corpus_fingerprint, builtin_documents
from remat.errors import ConfigError


def test_split_is_disjoint_complete_and_about_5_percent_validation() -> None:
    train, validation = builtin_documents("train"), builtin_documents("validation")
    assert sorted(train + validation) == sorted(set(topics.values()))  # texts shared by two topics count once
    assert not set(train) & set(validation)
    assert len(set(train)) == len(train) and len(set(validation)) == len(validation)
    assert 1 <= len(validation) <= 0.15 * len(topics)


def test_split_is_stable() -> None:
    assert builtin_documents("validation") == builtin_documents("validation")
    assert builtin_corpus_fingerprint() == builtin_corpus_fingerprint()
    assert len(builtin_corpus_fingerprint()) == 64


def test_unknown_split_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^validation_dataset\.split: the builtin corpus has splits"):
        builtin_documents("test", key="validation_dataset.split")
