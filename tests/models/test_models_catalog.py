"""The preset summary, and the docs table that is generated from it."""

from __future__ import annotations

from pathlib import Path

from remat.models.catalog import presets_markdown_table, summarize_presets
from remat.models.presets import preset_names

DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_summary_describes_every_preset() -> None:
    rows = {row.name: row for row in summarize_presets()}
    assert list(rows) == preset_names()
    moe = rows["qwen3-30b-a3b"]
    assert (moe.layers, moe.hidden_size, moe.attention_heads, moe.kv_heads) == (48, 2048, 32, 4)
    assert moe.mlp == "128 experts x 768, top-8" and rows["mixtral-8x7b"].mlp == "8 experts x 14336, top-2"
    assert rows["gemma-3n-e2b"].mlp == "8192"  # per-layer widths, all equal
    assert rows["tiny-llama"].vocab_from_tokenizer and not rows["llama-3.2-1b"].vocab_from_tokenizer


def test_docs_table_matches_the_code() -> None:
    assert presets_markdown_table() in DOCS.read_text()
