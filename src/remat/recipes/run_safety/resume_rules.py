"""The rules of a resume, key by key (`RESUME_RULES`), and the run identity they define.

Every recipe key falls in one class on resume (`remat.recipes.run_safety.resume_changes` applies them: the module docstring
there says what each class does). The refused keys and those compared as data are also what makes a different run:
`identity_digest` hashes their values, and `default_output_dir` names a run directory by it. Pure: this module reads
no recipe class, so the schema (`remat.recipes.config`) can name its default ``output_dir`` with it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

APPLIED, COMPATIBLE, REFUSED, DATA, IGNORED, WARNED = "applied", "compatible", "refused", "data", "ignored", "warned"


@dataclass(frozen=True)
class Rule:
    """The class of a config key on resume, and a few words: what happens (applied, compatible) or why it cannot
    change and what to do (refused)."""

    kind: str
    how: str


_MODEL = Rule(REFUSED, "the saved weights and optimizer state belong to the other model")
_TOKENIZER = Rule(REFUSED, "the saved model was trained on the other tokenizer's token ids")
_DATA_ORDER = Rule(REFUSED, "the saved data position counts rows of the other data order")
_APPLIED = Rule(APPLIED, "used from the next step on")
_SCHEDULE = Rule(APPLIED, "the lr schedule is rebuilt and positioned at the saved step")
_PARAM_GROUPS = Rule(APPLIED, "set in the optimizer's param groups")
_LAYOUT = Rule(COMPATIBLE, "same global batch; the data position is re-sharded to the same global sample")

#: dotted key (or ``section.*`` for every key below it) -> its class on resume. The most specific entry wins.
RESUME_RULES: dict[str, Rule] = {
    "seed": Rule(REFUSED, "the seed draws the data order that the saved position counts in"),
    "output_dir": Rule(IGNORED, ""),
    "custom_target_packages": _APPLIED,
    "model.*": _MODEL,
    "model.autocast": _APPLIED,
    "model.attn_implementation": _APPLIED,
    "model.document_attention": _APPLIED,
    "model.output_hidden_states": _APPLIED,
    "model.trust_remote_code": _APPLIED,
    "model.embedding_row_repair": Rule(IGNORED, ""),  # the pretrained weights as loaded; a resume loads its own
    "model.embedding_row_repair.*": Rule(IGNORED, ""),
    "model.dequantize": Rule(IGNORED, ""),  # how the pretrained weights load; a resume loads its own
    "tokenizer.*": _TOKENIZER,
    "dataset.*": Rule(DATA, "compared by the content of the tokenized rows"),
    "dataset.shuffle": _DATA_ORDER,
    "validation_dataset": _APPLIED,
    "validation_dataset.*": _APPLIED,
    "step_scheduler.global_batch_size": Rule(
        REFUSED, "the saved data position and schedule count global batches of the saved size; local_batch_size and "
                 "the number of processes may change"),
    "step_scheduler.local_batch_size": _LAYOUT,
    "step_scheduler.max_steps": _SCHEDULE,
    "step_scheduler.*": _APPLIED,
    "optimizer._target_": Rule(REFUSED, "the saved optimizer state belongs to the other optimizer class"),
    "optimizer.amsgrad": Rule(REFUSED, "amsgrad changes what the optimizer state holds"),
    "optimizer.lr": _SCHEDULE,
    "optimizer.*": _PARAM_GROUPS,
    "lr_scheduler.*": _SCHEDULE,
    "loss_fn.*": _APPLIED,
    "clip_grad_norm.*": _APPLIED,
    "compile.*": _APPLIED,
    "fp8.*": _APPLIED,
    "qat.*": _APPLIED,
    "distributed.strategy": _LAYOUT,
    "distributed.dp_size": _LAYOUT,
    "distributed.tp_size": _LAYOUT,
    "distributed.cp_size": _LAYOUT,
    "distributed.*": _APPLIED,
    "checkpoint.resume": Rule(IGNORED, ""),
    "checkpoint.*": _APPLIED,
    "logging.*": _APPLIED,
    "training.*": _APPLIED,
    "peft": Rule(REFUSED, "the saved state holds the other adapters (or none)"),
    "peft.*": Rule(REFUSED, "the saved adapters have the other shape"),
}
_UNKNOWN = Rule(WARNED, "remat has no rule for this key, so it is used as given: check that changing it mid-run is "
                        "safe")
_SCHEDULE_KEYS = ("optimizer.lr", "step_scheduler.max_steps")


def rule_for(key: str) -> Rule:
    """The `RESUME_RULES` entry of dotted ``key``: its own, else the nearest ``section.*`` above it, else warned."""
    if key in RESUME_RULES:
        return RESUME_RULES[key]
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        wildcard = ".".join(parts[:end]) + ".*"
        if wildcard in RESUME_RULES:
            return RESUME_RULES[wildcard]
    return _UNKNOWN


def identity_digest(config: Mapping[str, Any]) -> str:
    """8 hex digits over the values of the keys that make a different run (refused or compared as data)."""
    identity = {key: value for key, value in _leaves(config) if rule_for(key).kind in (REFUSED, DATA)}
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


def _leaves(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name, value in config.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, prefix=f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def default_output_dir(config: Mapping[str, Any]) -> str:
    """The ``output_dir`` of a recipe built in Python without one: ``outputs/run-<identity digest>``, so two
    different runs never share a directory by accident (a recipe file gets ``outputs/<file stem>``, see
    `remat.recipes.loader.load_recipe`)."""
    return f"outputs/run-{identity_digest(config)}"
