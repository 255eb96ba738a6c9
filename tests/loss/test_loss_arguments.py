"""A misspelt keyword of a loss constructor is one ConfigError with the closest allowed name, in Python as in YAML."""

from __future__ import annotations

import inspect

import pytest

from remat.errors import ConfigError
from remat.loss import FusedLinearCrossEntropy, MaskedCrossEntropy


@pytest.mark.parametrize(("cls", "given", "suggested"), [
    (FusedLinearCrossEntropy, "chunk_sz", "chunk_size"),
    (FusedLinearCrossEntropy, "grad_strategie", "grad_strategy"),
    (MaskedCrossEntropy, "ignore_idx", "ignore_index"),
])
def test_unknown_keyword_names_the_closest(cls: type, given: str, suggested: str) -> None:
    with pytest.raises(ConfigError, match=rf"{cls.__name__}\({given}=\.\.\.\): unknown argument; did you mean "
                                          rf"'{suggested}'\? Allowed: ignore_index, reduction"):
        cls(**{given: 4})


def test_the_signature_and_valid_calls_are_unchanged() -> None:
    assert list(inspect.signature(FusedLinearCrossEntropy).parameters)[:4] == [
        "ignore_index", "reduction", "logit_softcap", "chunk_size"]
    loss = FusedLinearCrossEntropy(-1, "sum", None, 8, grad_strategy="forward")
    assert (loss.ignore_index, loss.reduction) == (-1, "sum")
