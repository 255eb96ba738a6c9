"""`remat.prepare_trainer` in TRL's ``SFTTrainer`` and ``DPOTrainer`` (Trainer subclasses): a fixed policy gives their
own per-step losses and gradient norms bit for bit (DPO's reference model untouched); ``loss="fused"`` is refused in
one line, since TRL already replaces the model's forward with its own loss (never two losses); ``auto`` is refused in
DPO, whose step (chosen and rejected rows, a reference model) the planner does not model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import copy

import pytest
from datasets import Dataset
from tiny import tiny_causal_lm, tiny_word_tokenizer

import remat
from remat.checkpointing import remove_activation_checkpointing
from remat.errors import ConfigError

trl = pytest.importorskip("trl", reason="TRL is remat's optional extra (remat[trl]); the test extra installs it")


def _sft_trainer(tmp_path: Path) -> Any:
    tokenizer = tiny_word_tokenizer()
    texts = [" ".join(f"w{(i * 7 + j) % 250}" for j in range(30)) for i in range(16)]
    model = tiny_causal_lm(vocab_size=256)
    args = trl.SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                         gradient_accumulation_steps=2, max_steps=3, logging_steps=1, report_to=[], use_cpu=True,
                         seed=0, save_strategy="no", max_length=32, disable_tqdm=True)
    return trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                          processing_class=tokenizer)


def _logged(trainer: Any) -> list[tuple[float, float]]:
    return [(row["loss"], row["grad_norm"]) for row in trainer.state.log_history if "loss" in row]


def test_sft_trainer_with_a_policy_gives_its_own_losses_bit_for_bit(tmp_path: Path) -> None:
    plain = _sft_trainer(tmp_path / "plain")
    plain.train()
    trainer = _sft_trainer(tmp_path / "remat")
    remat.prepare_trainer(trainer, "selective")
    trainer.train()
    assert _logged(trainer) == _logged(plain)
    assert all(row["peak_mem_gib"] > 0 for row in trainer.state.log_history if "loss" in row)


def test_the_fused_loss_is_refused_where_trl_computes_its_own(tmp_path: Path) -> None:
    trainer = _sft_trainer(tmp_path)
    if "forward" not in vars(trainer.model):
        pytest.skip("this TRL leaves the model's forward as it is")
    with pytest.raises(ConfigError, match="loss: TRL's trainer already replaced the forward of LlamaForCausalLM"):
        remat.prepare_trainer(trainer, "selective", loss="fused")


def _dpo_trainer(tmp_path: Path) -> Any:
    tokenizer = _sft_trainer(tmp_path / "sft").processing_class
    model = tiny_causal_lm(vocab_size=256)
    rows = Dataset.from_dict({
        "prompt": [" ".join(f"w{(i * 5 + j) % 250}" for j in range(8)) for i in range(8)],
        "chosen": [" ".join(f"w{(i * 3 + j) % 250}" for j in range(10)) for i in range(8)],
        "rejected": [" ".join(f"w{(i * 11 + j) % 250}" for j in range(6)) for i in range(8)],
    })
    args = trl.DPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3,
                         logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no", max_length=32,
                         disable_tqdm=True)
    return trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=rows,
                          processing_class=tokenizer)


def test_dpo_trainer_with_a_policy_gives_its_own_losses_bit_for_bit(tmp_path: Path) -> None:
    plain = _dpo_trainer(tmp_path / "plain")
    plain.train()
    trainer = _dpo_trainer(tmp_path / "remat")
    plan = remat.prepare_trainer(trainer, "full")
    assert len(plan) == 2
    trainer.train()
    assert _logged(trainer) == _logged(plain) and len(_logged(plain)) == 3
    assert remove_activation_checkpointing(trainer.ref_model) == 0  # nothing was wrapped there


def test_auto_is_refused_in_dpo_in_one_line(tmp_path: Path) -> None:
    trainer = _dpo_trainer(tmp_path)
    with pytest.raises(ConfigError, match=r"^policy: 'auto' plans the causal-LM step of Trainer and TRL's SFTTrainer; "
                                          r"DPOTrainer runs another step"):
        remat.prepare_trainer(trainer, "auto", memory_budget="1GiB")
