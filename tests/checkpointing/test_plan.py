"""The plan says per block what was applied and why: a stable plain table, a rich table, one summary line."""

from __future__ import annotations

import json
import warnings

from ckpt_models import tiny_model

from remat.checkpointing import apply_activation_checkpointing


def test_table_of_a_per_layer_plan() -> None:
    model = tiny_model("llama")
    plan = apply_activation_checkpointing(
        model, {"mode": "full", "layers": {"1": "selective", "2": {"mode": "mlp", "offload": True}, "3": "none"}}
    )
    lines = str(plan).splitlines()
    assert lines[0] == (
        "full, per-layer: 1=selective, 2=mlp, 3=none: 3/4 blocks of LlamaForCausalLM (model.layers) "
        "[full 1, selective 1, mlp 1]"
    )
    assert lines[1].split() == ["#", "block", "type", "mode", "recomputes", "offload", "note"]
    assert lines[3].split() == ["0", "model.layers.0", "LlamaDecoderLayer", "full", "block", "-"]
    assert lines[4].split() == ["1", "model.layers.1", "LlamaDecoderLayer", "selective", "cheap", "ops", "-",
                                "layers['1']"]
    assert lines[5].split() == ["2", "model.layers.2", "LlamaDecoderLayer", "mlp", "mlp", "yes", "layers['2']"]
    assert lines[6].split() == ["3", "model.layers.3", "LlamaDecoderLayer", "none", "-", "-", "layers['3']"]
    assert any(line.startswith("note: use_cache set to False") for line in lines)
    assert plan.table() == str(plan)
    assert plan.wrapped_modules == ("model.layers.0", "model.layers.1", "model.layers.2.mlp")
    assert plan.modes() == {"full": 1, "selective": 1, "mlp": 1, "none": 1}


def test_fallback_rows_show_what_was_asked() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = apply_activation_checkpointing(tiny_model("gemma3n_text"), "sqrt")
    rows = plan.rows()
    assert rows[0][3] == "mlp (asked full)" and rows[0][4] == "mlp"
    assert rows[2][3] == "full" and rows[2][4] == "segment 2-3"
    assert plan.segments == ((2, 3),)
    assert plan.summary().endswith("1 segments, 2 fallbacks")


def test_rich_rendering_and_json() -> None:
    plan = apply_activation_checkpointing(tiny_model("gpt2"), {"every_n_layers": 2})
    text = plan.render_rich(width=160)
    assert "transformer.h.0" in text and "every_n_layers=2: not selected" in text
    assert plan.summary() in text.replace("\n", " ") or "2/4 blocks of GPT2LMHeadModel" in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["policy"] == {"mode": "full", "every_n_layers": 2}
    assert [layer["mode"] for layer in data["layers"]] == ["full", "none", "full", "none"]
    assert data["container"] == "transformer.h"
