"""Discovery finds the blocks and their attention / MLP sub-modules across architectures, and says when it cannot."""

from __future__ import annotations

import warnings

import pytest
import torch
from ckpt_models import tiny_model
from custom_models import MixerLM, NoStack, TinyLM

from remat.checkpointing.discovery import find_blocks, find_decoder
from remat.errors import CheckpointingError

# arch -> (container, attention names, mlp names, MoE)
EXPECTED = {
    "llama": ("model.layers", ("self_attn",), ("mlp",), False),
    "gemma2": ("model.layers", ("self_attn",), ("mlp",), False),
    "gpt2": ("transformer.h", ("attn",), ("mlp",), False),
    "gpt_neox": ("gpt_neox.layers", ("attention",), ("mlp",), False),
    "phi3": ("model.layers", ("self_attn",), ("mlp",), False),
    "mixtral": ("model.layers", ("self_attn",), ("mlp",), True),
    "qwen3_moe": ("model.layers", ("self_attn",), ("mlp",), True),
    "gemma3n_text": ("model.layers", ("self_attn",), ("mlp",), False),
}


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_transformers_blocks_and_submodules(arch: str) -> None:
    container, attention, mlp, moe = EXPECTED[arch]
    search = find_blocks(tiny_model(arch))
    assert search.method == "GradientCheckpointingLayer"
    assert search.container == container
    assert [b.name for b in search.blocks] == [f"{container}.{i}" for i in range(4)]
    assert [b.index for b in search.blocks] == [0, 1, 2, 3]
    assert all(b.attention == attention and b.mlp == mlp and b.is_moe == moe for b in search.blocks)


def test_kv_sharing_roles_of_gemma3n() -> None:
    # 4 layers, the last 2 read the keys/values that the last sliding and the last full layer before them store.
    search = find_blocks(tiny_model("gemma3n_text"))
    assert [b.kv_sharing for b in search.blocks] == ["store", "store", "reuse", "reuse"]
    assert all(b.kv_sharing is None for b in find_blocks(tiny_model("llama")).blocks)


def test_text_tower_of_a_multimodal_model_only() -> None:
    from transformers import AutoModelForImageTextToText, CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=16, patch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForImageTextToText.from_config(LlavaConfig(text_config=text, vision_config=vision))
    search = find_blocks(model)
    assert [b.name for b in search.blocks] == ["model.language_model.layers.0", "model.language_model.layers.1"]
    assert search.skipped == ("model.vision_tower.encoder.layers (3 blocks)",)
    assert find_decoder(model) is model.model.language_model


def test_peft_wrapper_is_looked_through() -> None:
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    search = find_blocks(peft_model)
    assert [b.name for b in search.blocks] == [f"base_model.model.model.layers.{i}" for i in range(4)]
    assert search.blocks[0].attention == ("self_attn",)


def test_custom_model_module_list() -> None:
    model = TinyLM()
    search = find_blocks(model)
    assert search.method == "ModuleList"
    assert search.container == "trunk.blocks"
    assert [b.name for b in search.blocks] == [f"trunk.blocks.{i}" for i in range(4)]
    assert search.blocks[0].attention == ("attn",) and search.blocks[0].mlp == ("mlp",)


def test_submodules_found_by_class_name_when_names_differ() -> None:
    model = TinyLM()
    for block in model.trunk.blocks:
        block.mixer = block.attn  # renamed children: class names Attention / FeedForward still say what they are
        block.ffwd = block.mlp
        del block.attn, block.mlp
    found = find_blocks(model).blocks[0]
    assert found.attention == ("mixer",) and found.mlp == ("ffwd",)


def test_block_pattern_as_path_and_as_regex() -> None:
    model = TinyLM()
    by_path = find_blocks(model, "trunk.blocks")
    assert by_path.method == "block_pattern" and len(by_path.blocks) == 4
    by_regex = find_blocks(model, r"trunk\.blocks\.[13]")
    assert [b.name for b in by_regex.blocks] == ["trunk.blocks.1", "trunk.blocks.3"]
    by_broad_regex = find_blocks(model, r"trunk\.blocks\.\d+.*")  # sub-modules of a match are not blocks too
    assert [b.name for b in by_broad_regex.blocks] == [f"trunk.blocks.{i}" for i in range(4)]
    single = find_blocks(model, "trunk.blocks.2")
    assert [b.name for b in single.blocks] == ["trunk.blocks.2"]


def test_block_pattern_matching_nothing_is_an_error() -> None:
    with pytest.raises(CheckpointingError) as info:
        find_blocks(TinyLM(), r"decoder\.layers\.\d+")
    message = str(info.value)
    assert "block_pattern: 'decoder\\\\.layers\\\\.\\\\d+' matches no module of TinyLM" in message
    assert "'embed'" in message  # shows what module names look like


def test_no_blocks_found_names_model_and_what_was_searched() -> None:
    with pytest.raises(CheckpointingError) as info:
        find_blocks(NoStack())
    message = str(info.value)
    assert message.startswith("no transformer blocks found in NoStack")
    assert "GradientCheckpointingLayer" in message and "nn.ModuleList" in message and "block_pattern" in message


def test_blocks_without_submodules_are_still_blocks() -> None:
    search = find_blocks(MixerLM())
    assert len(search.blocks) == 3
    assert search.blocks[0].attention == () and search.blocks[0].mlp == ()
    assert torch.is_tensor(next(search.blocks[0].module.parameters()))
