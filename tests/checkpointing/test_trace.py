"""`REMAT_SELECTIVE_AC_TRACE=1` logs each unique op of a selectively checkpointed model once, with its decision."""

from __future__ import annotations

import logging

import pytest
import torch
from ckpt_models import batch, tiny_model

from remat.checkpointing import apply_activation_checkpointing
from remat.checkpointing.selective import reset_selective_trace


def _one_step(model: torch.nn.Module) -> None:
    ids = batch()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def test_trace_env_var_logs_decisions_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.0  # SDPA without dropout is saved (with dropout it is recomputed)
    apply_activation_checkpointing(model, "selective")
    monkeypatch.setenv("REMAT_SELECTIVE_AC_TRACE", "1")
    reset_selective_trace()
    with caplog.at_level(logging.INFO, logger="remat.checkpointing.selective"):
        _one_step(model)
        first = [r.getMessage() for r in caplog.records if r.name == "remat.checkpointing.selective"]
        caplog.clear()
        _one_step(model)
        second = [r.getMessage() for r in caplog.records if r.name == "remat.checkpointing.selective"]
    reset_selective_trace()
    assert second == []  # each unique op once per process
    decisions = {line.split()[0] for line in first}
    assert decisions == {"SAVE", "ALTERNATE", "RECOMPUTE"}
    assert len(first) == len(set(first))
    sdpa = [line for line in first if "aten._scaled_dot_product_flash_attention_for_cpu.default" in line]
    assert len(sdpa) == 1 and sdpa[0].startswith("SAVE") and "[2, 4, 16, 8] float32" in sdpa[0]
    assert any(line.startswith("ALTERNATE") and "aten.mm.default" in line for line in first)


def test_no_trace_without_the_env_var(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_model("llama")
    apply_activation_checkpointing(model, "selective")
    monkeypatch.delenv("REMAT_SELECTIVE_AC_TRACE", raising=False)
    reset_selective_trace()
    with caplog.at_level(logging.INFO, logger="remat.checkpointing.selective"):
        _one_step(model)
    assert not [r for r in caplog.records if r.name == "remat.checkpointing.selective"]
