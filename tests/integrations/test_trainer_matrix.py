"""#22's grid: ``transformers.Trainer`` and TRL's ``SFTTrainer``, on a tiny Llama, Qwen3 and Qwen3-MoE, with and
without LoRA, gradient accumulation 2. Under a fixed policy each gives the per-step losses and gradient norms of the
same trainer without remat, bit for bit; the logs carry the peak. (The fused loss, ``auto`` and the fit check are
tested on the Llama Trainer and the MoE in test_hf_trainer.py, SFTTrainer's own forward in test_trl.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import tiny_causal_lm, tiny_word_tokenizer

import remat

ROWS, LENGTH, VOCAB = 8, 32, 256


def _model(arch: str, lora: bool) -> Any:
    model: Any = tiny_causal_lm(arch, vocab_size=VOCAB, max_position_embeddings=LENGTH)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    return model


def _rows() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(0, VOCAB, (ROWS, LENGTH),
                                                                                generator=generator)]


def _trainer(kind: str, arch: str, lora: bool, out: Path) -> Any:
    common = {"output_dir": str(out), "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
              "max_steps": 2, "learning_rate": 1e-3, "logging_steps": 1, "report_to": [], "use_cpu": True, "seed": 0,
              "save_strategy": "no", "disable_tqdm": True}
    if kind == "trainer":
        from transformers import Trainer, TrainingArguments

        return Trainer(model=_model(arch, lora), args=TrainingArguments(**common), train_dataset=_rows())
    trl = pytest.importorskip("trl", reason="TRL is remat's optional extra (remat[trl]); the test extra installs it")
    from datasets import Dataset

    rows = [{"input_ids": row["input_ids"].tolist()} for row in _rows()]  # tokenized rows, as SFTTrainer takes them
    args = trl.SFTConfig(**common, max_length=LENGTH)
    return trl.SFTTrainer(model=_model(arch, lora), args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tiny_word_tokenizer())


def _logged(trainer: Any) -> list[tuple[float, float]]:
    return [(row["loss"], row["grad_norm"]) for row in trainer.state.log_history if "loss" in row]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full-weights", "lora"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_a_fixed_policy_gives_each_trainers_own_losses_bit_for_bit(kind: str, arch: str, lora: bool,
                                                                   tmp_path: Path) -> None:
    plain = _trainer(kind, arch, lora, tmp_path / "plain")
    plain.train()
    trainer = _trainer(kind, arch, lora, tmp_path / "remat")
    plan = remat.prepare_trainer(trainer, "full" if arch == "qwen3_moe" else "selective")
    assert plan.wrapped_modules
    trainer.train()
    assert len(_logged(plain)) == 2 and _logged(trainer) == _logged(plain)
    assert all(row["peak_mem_gib"] > 0 for row in trainer.state.log_history if "loss" in row)
