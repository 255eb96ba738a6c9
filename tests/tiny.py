"""The tiny models and recipes tests build on, in one place: `tiny_causal_lm` for a model object of any causal-LM
architecture in transformers, `tiny_recipe` for a recipe mapping. Imported as a module (``from tiny import ...``),
like ``processes``; sizes a test depends on are passed explicitly, so a change of the defaults shows up as a diff."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

SIZES: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "vocab_size": 256}
"""Every tiny model's shape unless a test says otherwise: 2 blocks of hidden size 64, 4 query and 2 key/value heads."""

ARCH_SIZES: dict[str, dict[str, Any]] = {
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}
"""What some architectures need besides `SIZES` to stay tiny (their experts, a head size matching the hidden size)."""

TINY_LLAMA_PRESET: dict[str, Any] = {"preset": "tiny-llama",
                                     "config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                                "num_attention_heads": 4, "num_key_value_heads": 2}}
"""A recipe's ``model`` section for the same shape (the preset's own vocabulary unless ``config`` says)."""


def tiny_causal_lm(arch: str = "llama", *, seed: int = 0, **config: Any) -> nn.Module:
    """A randomly initialised ``AutoModelForCausalLM`` of model type ``arch`` (``"llama"``, ``"qwen3_moe"``, ...) with
    `SIZES` (and `ARCH_SIZES`) overridden by ``config``, its weights drawn after ``torch.manual_seed(seed)``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**SIZES, **ARCH_SIZES.get(arch, {}), **config}
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **settings))


def tiny_word_tokenizer() -> Any:
    """A word-level tokenizer of 250 words ``w0`` ... ``w249`` plus unknown, padding and end tokens (ids 250-252),
    for the trainers that take a tokenizer (TRL's), without the Hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {**{f"w{i}": i for i in range(250)}, "[UNK]": 250, "[PAD]": 251, "[EOS]": 252}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


def tiny_recipe(**sections: Any) -> dict[str, Any]:
    """A recipe of a few CPU steps of the tiny Llama (`TINY_LLAMA_PRESET`) on the builtin dataset, 32-token rows,
    global batch 4 in micro-batches of 2; each keyword replaces a top-level key, and a mapping given for a mapping
    section updates that section's keys (one level: ``model={"config": {...}}`` replaces the whole ``config``)."""
    recipe: dict[str, Any] = {
        "seed": 7,
        "model": copy.deepcopy(TINY_LLAMA_PRESET),
        "tokenizer": {"vocab_size": 512},
        "dataset": {"seq_length": 32},
        "step_scheduler": {"global_batch_size": 4, "local_batch_size": 2, "max_steps": 6},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 2},
        "logging": {"progress": "plain"},
        "checkpoint": {"keep_last": 3},
        "distributed": {"device": "cpu"},  # expectations on tracked `mem` and its log line are the CPU's
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(recipe.get(name), dict):
            recipe[name] = {**recipe[name], **copy.deepcopy(value)}
        else:
            recipe[name] = copy.deepcopy(value)
    return recipe


def recipe_step_gradients(recipe: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """One step of a validated recipe's model (built after ``torch.manual_seed(0)``) on the estimate's synthetic
    batch, as a recipe's run builds it: (the loss, each parameter's gradient by name). Two recipes that differ only
    in their checkpointing policy must give equal ones."""
    from remat.distributed import DistributedSetup
    from remat.estimate import StepSettings
    from remat.estimate.simulate import make_batch
    from remat.recipes.build import build_recipe_model, build_training_module

    torch.manual_seed(0)
    model = build_recipe_model(recipe, vocab_size=None)
    root = build_training_module(model, recipe, DistributedSetup.from_config(recipe.distributed, device="cpu"))
    batch = make_batch(recipe, StepSettings(target="cpu").run(), model.config.vocab_size)
    loss = root(batch, num_label_tokens=int((batch["labels"] != -100).sum()))
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
