"""`remat.prepare_trainer` in TRL's ``SFTTrainer`` and ``DPOTrainer`` (Trainer subclasses): a fixed policy gives their
own per-step losses and gradient norms bit for bit (DPO's reference model untouched); ``loss="fused"`` is refused in
one line, since TRL already replaces the model's forward with its own loss (never two losses); ``auto`` plans
SFTTrainer's own step (TRL's fused LM head, its padding-free rows, LoRA) within 2% of the tracked peak, and is
refused in DPO, whose step (chosen and rejected rows, a reference model) the planner does not model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import copy

import pytest
import torch
from datasets import Dataset
from tiny import tiny_causal_lm, tiny_word_tokenizer

import remat
from remat.checkpointing import remove_activation_checkpointing
from remat.errors import ConfigError
from remat.recipes.build import lora_section

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


# --- policy="auto" in SFTTrainer: the step TRL runs -------------------------------------------------------------

LONG = 64  # every text is longer: every row (and every packed row) is truncated to exactly LONG tokens


def _long_sft_trainer(tmp_path: Path, vocab: int, rows: str, **arguments: Any) -> Any:
    texts = [" ".join(f"w{(i * 7 + j) % 250}" for j in range(2 * LONG)) for i in range(16)]
    args = trl.SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3,
                         logging_steps=1, report_to=[], use_cpu=True, seed=0, save_strategy="no", max_length=LONG,
                         disable_tqdm=True, packing=rows == "packed", **arguments)
    peft_config = None
    if rows == "lora":
        peft = pytest.importorskip("peft")
        peft_config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    return trl.SFTTrainer(model=tiny_causal_lm(vocab_size=vocab, num_hidden_layers=4), args=args,
                          train_dataset=Dataset.from_dict({"text": texts}), processing_class=tiny_word_tokenizer(),
                          peft_config=peft_config)


def _budget_between_full_and_none(trainer: Any, rows: str) -> int:
    """Halfway between the predicted peaks of full and none for the trainer's step (TRL's loss, its rows, LoRA)."""
    from remat.loss.trl_head import trl_head_options

    base = trainer.model.get_base_model() if rows == "lora" else trainer.model
    shape = {"batch_size": 1, "seq_length": 2 * LONG, "documents_per_row": 2} if rows == "packed" else {
        "batch_size": 2, "seq_length": LONG}
    none, full = (remat.estimate_memory(
        base.config, **shape, target="cpu", policy=policy, loss="remat.loss.trl_head.TRLFusedLMHead",
        loss_kwargs=trl_head_options(base), peft=lora_section(trainer.model, caller="test"),
        optimizer_kwargs={"lr": trainer.args.learning_rate, "weight_decay": trainer.args.weight_decay},
        clip_grad_norm=trainer.args.max_grad_norm).peak_bytes for policy in ("none", "full"))
    assert none > full
    return (none + full) // 2


@pytest.mark.parametrize(("vocab", "rows"), [(1536, "padded"), (32768, "padded"), (1536, "packed"), (32768, "packed"),
                                            (1536, "lora"), (32768, "lora")])
def test_auto_plans_the_sft_trainers_own_step_within_its_budget(tmp_path: Path, vocab: int, rows: str) -> None:
    """TRL's fused LM head (a [tokens, 32768] tile buffer at any vocabulary, float32 gradient accumulators), its
    padding-free packed rows and LoRA are in the plan: every step within the budget, the step the prediction is of
    (step 2, with AdamW's state) within 2% of it. Before, the plan was the plain Trainer's (-49% to -84%)."""
    trainer = _long_sft_trainer(tmp_path, vocab, rows)
    if "forward" not in vars(trainer.model.get_base_model() if rows == "lora" else trainer.model):
        pytest.skip("this TRL leaves the model's forward as it is (its step is the plain Trainer's)")
    budget = _budget_between_full_and_none(trainer, rows)
    plan = remat.prepare_trainer(trainer, "auto", memory_budget=budget, target="cpu")
    trainer.train()
    peaks = [row["peak_mem_gib"] * 2**30 for row in trainer.state.log_history if "loss" in row]
    assert len(peaks) == 3 and all(peak <= budget * 1.0001 for peak in peaks), (peaks, budget)
    assert abs(peaks[1] / plan.peak_bytes - 1) < 0.02, (peaks, plan.peak_bytes)


def test_trls_fused_head_as_a_remat_loss_is_trls_own_bit_for_bit() -> None:
    from trl.trainer.utils import add_fused_lm_head

    from remat.loss.trl_head import TRLFusedLMHead, trl_head_options

    theirs, ours = tiny_causal_lm(vocab_size=256), tiny_causal_lm(vocab_size=256)
    add_fused_lm_head(theirs, outputs=("log_probs", "entropy", "is_top1"))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :4] = -100
    expected = theirs(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=17).loss
    expected.backward()
    loss = TRLFusedLMHead(**trl_head_options(theirs))(ours.model(input_ids=ids).last_hidden_state,
                                                       ours.lm_head.weight, labels, num_label_tokens=17)
    loss.backward()
    assert torch.equal(loss, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(theirs.parameters(), ours.parameters()))
    assert trl_head_options(ours) is None  # a model TRL did not patch
    with pytest.raises(ConfigError, match=r"^loss_fn.device_kernels: true runs TRL's GPU path .* allowed on real "
                                          r"tensors: false"):
        TRLFusedLMHead(device_kernels=True)(torch.zeros(1, 2, 64), ours.lm_head.weight, labels[:1, :2])


def test_the_cuda_estimate_of_trls_step_takes_its_gpu_path() -> None:
    """On a CUDA target TRL scores only the labelled positions and folds its tiles in Triton kernels, stubbed out on
    fake tensors (a real boolean mask selecting fake rows): the estimate runs that path (another figure than TRL's CPU
    path asked for by hand on the same target), and both hold TRL's [tokens, 32768] tile buffer, which remat's plain
    loss at this vocabulary never allocates."""
    from remat.loss.trl_head import SFT_OUTPUTS

    config = tiny_causal_lm(vocab_size=1536).config
    step = {"batch_size": 2, "seq_length": 32, "policy": "none", "target": "cuda"}
    trl_loss = {"loss": "remat.loss.trl_head.TRLFusedLMHead"}
    gpu_path = remat.estimate_memory(config, loss_kwargs={"outputs": list(SFT_OUTPUTS)}, **trl_loss, **step)
    cpu_path = remat.estimate_memory(config, loss_kwargs={"outputs": list(SFT_OUTPUTS), "device_kernels": False},
                                     **trl_loss, **step)
    plain = remat.estimate_memory(config, loss="plain", **step)
    tile_buffer = 2 * 31 * 32768 * 4  # the shifted tokens x TRL's vocabulary chunk, float32
    logits = 2 * 31 * 1536 * 4  # plain's peak holds its logits, their log-softmax and gradient; TRL's never does
    # On the GPU path the backward folds tiles in place too (NOTE [ TRL's backward runs after the call ]): no float32
    # tile temporaries, which the CPU path makes.
    assert gpu_path.peak_bytes < cpu_path.peak_bytes
    for estimate in (gpu_path, cpu_path):
        assert estimate.peak_bytes - plain.peak_bytes >= tile_buffer - 3 * logits, (estimate.peak_bytes,
                                                                                     plain.peak_bytes)


def test_auto_is_refused_where_sft_runs_a_second_forward(tmp_path: Path) -> None:
    trainer = _long_sft_trainer(tmp_path, 256, "padded", label_smoothing_factor=0.1)
    if "forward" not in vars(trainer.model):
        pytest.skip("this TRL leaves the model's forward as it is")
    with pytest.raises(ConfigError, match=r"^policy: 'auto' plans SFTTrainer's step with TRL's fused LM head; with "
                                          r"label_smoothing_factor TRL runs"):
        remat.prepare_trainer(trainer, "auto", memory_budget="1GiB", target="cpu")
