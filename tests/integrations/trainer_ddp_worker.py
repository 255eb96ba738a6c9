"""One `transformers.Trainer` run with `remat.prepare_trainer` (selective checkpointing, the fused loss), as one
process or as a torchrun worker (DDP over gloo): ``trainer_ddp_worker.py OUT PER_DEVICE_BATCH``. Rank 0 writes the
logged losses and gradient norms to OUT. The global batch is PER_DEVICE_BATCH x processes x 2 (accumulation)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import remat

ROWS, LENGTH, VOCAB = 32, 32, 256


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for index in range(ROWS):
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=generator)
        labels = ids.clone()
        labels[: 2 + index % 7] = -100  # prompts of several lengths: ranks hold different numbers of label tokens
        rows.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones(LENGTH, dtype=torch.long)})
    return rows


def main() -> None:
    out, per_device = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=LENGTH)
    args = TrainingArguments(output_dir=str(out.parent / "trainer"), per_device_train_batch_size=per_device,
                             gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, logging_steps=1,
                             report_to=[], use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
                             ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=dataset())
    remat.prepare_trainer(trainer, "selective", loss="fused")
    trainer.train()
    if trainer.args.process_index == 0:
        rows = [row for row in trainer.state.log_history if "loss" in row]
        out.write_text(json.dumps({"world_size": trainer.args.world_size,
                                   "loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows]}))


if __name__ == "__main__":
    main()
    # Leave at once (remat.distributed.exit): gloo's worker thread can abort Python's teardown ("terminate called
    # without an active exception"), and torchrun then reports the run as failed.
    import torch.distributed as dist

    from remat.distributed.exit import exit_now

    if dist.is_initialized():
        dist.destroy_process_group()
    exit_now(0)
