"""Packed rows fed to a real HF causal LM: documents in one row do not see each other.

transformers derives a block-diagonal mask from restarting `position_ids` only when no attention mask and no KV cache
is in play, so training must run the model with `use_cache=False` (the HF default, True, builds a cache).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from remat.data import DatasetConfig, build_dataset


def test_packed_documents_are_isolated_by_position_ids(word_tok, wid, write_jsonl) -> None:
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=len(word_tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    path = write_jsonl([{"text": "a b c d e"}, {"text": "f g h i j k l m n"}])
    packed = build_dataset(DatasetConfig(path=str(path), seq_length=18), word_tok)[0]
    alone = build_dataset(DatasetConfig(path=str(path), seq_length=11, packing=False), word_tok)[1]
    assert packed["input_ids"][7:].tolist() == [0] + wid("f g h i j k l m n") + [1]
    with torch.no_grad():
        batch = {name: tensor[None] for name, tensor in packed.items()}
        packed_logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        alone_logits = model(input_ids=alone["input_ids"][None], attention_mask=alone["attention_mask"][None]).logits
        with_cache = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=True).logits
        loss = model(**batch, use_cache=False).loss
    torch.testing.assert_close(packed_logits[0, 7:], alone_logits[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(with_cache[0, 7:], alone_logits[0], atol=1e-3)  # with a cache the 2nd doc sees the 1st
    # The loss averages over 16 targets: 5 letters + EOS, then 9 letters + EOS (the second BOS is masked).
    logits, labels = packed_logits[0, :-1], batch["labels"][0, 1:]
    expected = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
    assert int((labels != -100).sum()) == 16
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
