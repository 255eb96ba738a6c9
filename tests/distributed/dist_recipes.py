"""Tiny recipes shared by the distributed tests and the worker script torchrun starts (same data, same model)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, NoReturn

# torchrun starts the workers as scripts of this folder: the shared helpers of tests/ are one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import tiny_recipe as shared_tiny_recipe  # noqa: E402

TINY_MODEL = {"preset": "tiny-llama",
              "config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2}}
GLOBAL_BATCH = 8
WORLD_SIZE = 2

#: name -> (strategy, activation checkpointing, fused loss, tied embeddings, tp_size). Every case trains the same
#: global batches as the single-process run of the same model and loss (`reference_key`).
PARITY_CASES: dict[str, tuple[str, Any, bool, bool, int]] = {
    "fsdp2-none": ("fsdp2", False, False, True, 1),
    "fsdp2-full": ("fsdp2", "full", False, True, 1),
    "fsdp2-selective": ("fsdp2", "selective", False, True, 1),
    "fsdp2-fused": ("fsdp2", "full", True, False, 1),
    "fsdp2-fused-tied": ("fsdp2", "selective", True, True, 1),
    "fsdp2-tp2": ("fsdp2", "full", False, True, 2),
    "fsdp2-sqrt": ("fsdp2", "sqrt", False, True, 1),  # one segment of both blocks: one FSDP2 unit (shard_groups)
    "ddp-none": ("ddp", False, False, True, 1),
    "ddp-full": ("ddp", "full", False, True, 1),
    "ddp-selective": ("ddp", "selective", False, True, 1),
    "ddp-fused": ("ddp", "selective", True, False, 1),
}


def reference_key(case: str) -> tuple[bool, bool]:
    """(fused, tied): what the single-process reference of a parity case trains."""
    _, _, fused, tied, _ = PARITY_CASES[case]
    return fused, tied


def tiny_recipe(output_dir: Path, *, strategy: str = "single", checkpointing: Any = False, fused: bool = False,
                tied: bool = True, tp_size: int = 1, cp_size: int = 1, max_steps: int = 4, device: str = "cpu",
                **sections: Any) -> dict[str, Any]:
    """The shared tiny recipe (`tiny.tiny_recipe`) as the distributed tests train it: 2-layer, hidden-64 Llama steps
    over global batches of 8 rows of 32 tokens (2 accumulation steps per rank: local batch 2 on each of 2
    data-parallel ranks, 4 in a single process or on 2 context-parallel ranks), validated every 2 steps, no
    checkpoints. On the CPU (gloo) unless ``device`` says otherwise, GPUs or not. ``sections`` update this recipe's
    sections one level deep, as the shared helper's do."""
    data_parallel = WORLD_SIZE // (tp_size * cp_size) if strategy != "single" else 1
    model = copy.deepcopy(TINY_MODEL)
    model["config"]["tie_word_embeddings"] = tied
    if fused:
        model["output_hidden_states"] = True
    recipe = shared_tiny_recipe(
        seed=11, output_dir=str(output_dir), model=model,
        dataset={"max_samples": 20},  # 20 documents: ~1700 rows, plenty for a few steps
        validation_dataset={"split": "validation", "seq_length": 32},
        step_scheduler={"global_batch_size": GLOBAL_BATCH, "local_batch_size": GLOBAL_BATCH // 2 // data_parallel,
                        "max_steps": max_steps, "val_every_steps": 2, "val_batches": 3},
        lr_scheduler={"warmup_steps": 1},
        loss_fn={"_target_": "remat.loss.FusedLinearCrossEntropy" if fused else "remat.loss.MaskedCrossEntropy"},
        distributed={"strategy": strategy, "activation_checkpointing": checkpointing, "tp_size": tp_size,
                     "cp_size": cp_size, "device": device})
    recipe["checkpoint"] = {"enabled": False}  # a test that enables checkpoints gets the default retention
    for name, value in sections.items():
        recipe[name] = {**recipe[name], **value} if isinstance(recipe.get(name), dict) else value
    return recipe


def leave_process_group() -> NoReturn:
    """End a worker whose report is written: leave the process group and exit at once (`remat.distributed.exit`:
    gloo's worker thread can otherwise abort Python's teardown, and torchrun reports the run as failed)."""
    import torch.distributed as dist

    from remat.distributed.exit import exit_now

    dist.destroy_process_group()
    exit_now(0)
