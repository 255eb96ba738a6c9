"""What a loss consumes, in a module without torch (the recipe loader reads it while validating a recipe).

Each remat loss class declares ``consumes``: the model's logits (``loss(logits, labels, num_label_tokens=...)``) or
its last hidden states plus the output head (``loss(hidden_states, weight, labels, bias=..., num_label_tokens=...)``).
The recipe derives the model's outputs from it.
"""

from __future__ import annotations

from typing import Literal, get_args

LossInput = Literal["logits", "hidden_states"]
LOSS_INPUTS: tuple[str, ...] = get_args(LossInput)


def loss_input(loss: object) -> LossInput | None:
    """The ``consumes`` declaration of a loss class or instance, or None if it declares none (not a remat loss)."""
    consumes = getattr(loss, "consumes", None)
    return consumes if consumes in LOSS_INPUTS else None
