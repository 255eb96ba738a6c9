"""Context-parallel cases shared by the test and the worker torchrun starts (`cp_worker.py`): the same tiny models,
the same packed batch, the loss and the gradients of one forward+backward.

The batch's documents cross every shard boundary for ``cp_size`` 2 and 4 (rows of 30 tokens: padded to 32 under
``cp_size`` 4), and the two rows are cut differently, so document-wise attention meets non-uniform rows.
"""

from __future__ import annotations

from typing import Any

import torch

#: name -> (model, policy, fused loss, strategy, cp_size[, tp_size]); the world size is the one the worker runs on.
CASES_2: dict[str, tuple[str, Any, bool, str, int]] = {
    "llama-none-plain-ddp": ("llama", False, False, "ddp", 2),
    "llama-full-fused-ddp": ("llama", "full", True, "ddp", 2),
    "llama-selective-plain-fsdp2": ("llama", "selective", False, "fsdp2", 2),
    "qwen3-none-fused-fsdp2": ("qwen3", False, True, "fsdp2", 2),
    "qwen3-full-plain-ddp": ("qwen3", "full", False, "ddp", 2),
    "qwen3-selective-fused-ddp": ("qwen3", "selective", True, "ddp", 2),
    "llama-attention-eager-ddp": ("llama-eager", "attention", False, "ddp", 2),
    "llama-tiled-offload-fused-fsdp2": ("llama", {"mode": "full", "tiled": True, "tile_tokens": 4, "offload": True},
                                        True, "fsdp2", 2),
    "qwen3-sqrt-plain-ddp": ("qwen3", "sqrt", False, "ddp", 2),
}
CASES_4: dict[str, tuple[str, Any, bool, str, int]] = {
    "qwen3-full-fused-ddp-cp4": ("qwen3", "full", True, "ddp", 4),  # 2 key/value heads over 4 ranks: repeated
    "llama-selective-plain-ddp-cp4": ("llama", "selective", False, "ddp", 4),
    "llama-full-fused-fsdp2-dp2xcp2": ("llama", "full", True, "fsdp2", 2),
    "qwen3-none-plain-fsdp2-dp2xcp2": ("qwen3", False, False, "fsdp2", 2),
    # 4 heads over tp 2, each rank's 2 over cp 2; its one key/value head repeated for the 2 context ranks
    "llama-full-fused-fsdp2-cp2xtp2": ("llama", "full", True, "fsdp2", 2, 2),
    # planned on rank 0 for a budget midway between its none and full estimates (one shard of 8 tokens per row),
    # from inside the job (in child processes), and sent to the other ranks
    "qwen3-auto-fused-ddp-cp4": ("qwen3", "auto", True, "ddp", 4),
}
ROWS = 2


def tiny_model(kind: str) -> torch.nn.Module:
    """A 2-layer float32 Llama (4 heads, 2 key/value heads) or Qwen3 (8 heads, 2 key/value heads), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from remat.models.document_attention import use_document_attention

    torch.manual_seed(0)
    common = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_key_value_heads": 2, "attn_implementation": "eager" if kind.endswith("eager") else "sdpa"}
    if kind.startswith("llama"):
        model = LlamaForCausalLM(LlamaConfig(num_attention_heads=4, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(num_attention_heads=8, head_dim=8, **common))
    use_document_attention(model, "auto", packed=True)
    return model.float()


def packed_batch() -> dict[str, torch.Tensor]:
    """Two rows of 30 tokens: documents of 5, 13 and 12 tokens, and of 9 and 21; each document's first token has
    no label."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 97, (ROWS, 30), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in ((5, 13, 12), (9, 21))])
    labels = input_ids.clone()
    labels[positions == 0] = -100
    return {"input_ids": input_ids, "position_ids": positions, "labels": labels}


def loss_and_grads(kind: str, policy: Any, fused: bool, strategy: str, cp_size: int,
                   tp_size: int = 1) -> dict[str, Any]:
    """One forward+backward of the batch: the summed loss and every parameter's full gradient (on every rank).
    ``strategy`` "single" is the one-process reference; otherwise a torchrun worker's share, rows split over the
    data-parallel ranks."""
    from remat.distributed import DistributedSetup
    from remat.loss import FusedLinearCrossEntropy, MaskedCrossEntropy
    from remat.recipes.model_loss import CausalLMLoss

    model = tiny_model(kind)
    batch = packed_batch()
    label_tokens = int((batch["labels"][:, 1:] != -100).sum())
    if policy == "auto":
        policy = planned(model, fused, strategy, cp_size)
    setup = DistributedSetup.build(strategy=strategy, activation_checkpointing=policy, cp_size=cp_size,  # type: ignore[arg-type]
                                   tp_size=tp_size, device="cpu")
    if setup.dp_size > 1:
        rows = ROWS // setup.dp_size
        batch = {k: v[setup.dp_rank * rows:(setup.dp_rank + 1) * rows] for k, v in batch.items()}
    loss_fn = FusedLinearCrossEntropy() if fused else MaskedCrossEntropy()
    compute = CausalLMLoss(model, loss_fn, use_hidden_states=fused, context=setup.context)
    root = setup.parallelize(model, root=compute)
    loss = root(batch, num_label_tokens=label_tokens)
    (loss * setup.shard_count).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).tolist()
    report = {"loss": setup.sum_over_shards([float(loss.detach())])[0], "grads": grads,
              "describe": setup.describe()}
    return report  # the worker's process group stays up for the next case, which enables its own context group


def planned(model: torch.nn.Module, fused: bool, strategy: str, cp_size: int) -> Any:
    """`remat.plan_activation_checkpointing` for a rank's step (its row shards, the job's ranks), with a budget
    midway between the estimated none and full peaks, made on rank 0 and sent to the others (each rank could plan
    alike; one child's imports on 2 cores is what this saves). The worker has joined its process group, so the
    estimates and the plan run in child processes (`remat._child`). Checks that the plan fits and is
    neither none nor full."""
    import torch.distributed as dist

    from remat import estimate_memory, plan_activation_checkpointing

    assert dist.is_initialized()  # the case under test: planning from inside the job
    world = dist.get_world_size()
    step = {"batch_size": ROWS // (world // cp_size), "seq_length": 32, "strategy": strategy, "world_size": world,
            "cp_size": cp_size, "loss": "fused" if fused else "plain", "target": "cpu", "documents_per_row": 3}
    sent: list[Any] = [None]
    if dist.get_rank() == 0:
        none, full = (estimate_memory(model.config, policy=p, dtype="float32", **step).peak_bytes
                      for p in ("none", "full"))
        budget = (none + full) // 2
        plan = plan_activation_checkpointing(model, memory_budget=f"{budget}B", **step)  # a tiny budget
        assert plan.peak_bytes <= budget, plan.summary()
        sent = [plan.policy.to_dict()]
    dist.broadcast_object_list(sent, src=0)
    assert sent[0] not in ("none", "full", {"mode": "none"}, {"mode": "full"}), sent[0]
    return sent[0]


#: name -> (checkpointing, loss class, strategy, cp_size, tp_size, seq_length): recipes on 2 ranks whose tracked step
#: peak the estimate must equal.
MEMORY_CASES: dict[str, tuple[Any, str, str, int, int, int]] = {
    "none-plain": (False, "MaskedCrossEntropy", "ddp", 2, 1, 64),
    "full-plain": ("full", "MaskedCrossEntropy", "ddp", 2, 1, 64),
    "selective-fused": ("selective", "FusedLinearCrossEntropy", "ddp", 2, 1, 64),
    # FSDP2 over the 2 ranks (dp x cp flattened): the root's gathered parameters held through the step
    "fsdp2-full-plain": ("full", "MaskedCrossEntropy", "fsdp2", 2, 1, 64),
    # longer rows, so that what selective checkpointing saves makes the peak: the all-to-all outputs, once each
    "fsdp2-selective-plain-512": ("selective", "MaskedCrossEntropy", "fsdp2", 2, 1, 512),
    # tensor parallelism instead: the row-wise linears' all-reduced outputs saved, once each
    "fsdp2-tp2-selective-plain-512": ("selective", "MaskedCrossEntropy", "fsdp2", 1, 2, 512),
}


def memory_recipe(output_dir: str, checkpointing: Any, loss: str, strategy: str = "ddp", cp_size: int = 2,
                  tp_size: int = 1, seq_length: int = 64) -> dict[str, Any]:
    """2 layers of tiny-llama, packed rows of ``seq_length`` tokens, DDP (or FSDP2) over 2 ranks that share each row
    (``cp_size`` 2) or each block's weights (``tp_size`` 2), memory tracked; 2 steps (the second has the optimizer
    state)."""
    rows = 2 if seq_length <= 64 else 1
    return {
        "output_dir": output_dir,
        "model": {"preset": "tiny-llama", "config": {"num_hidden_layers": 2}},
        "dataset": {"seq_length": seq_length},
        "step_scheduler": {"global_batch_size": rows, "local_batch_size": rows, "max_steps": 2},
        "loss_fn": {"_target_": f"remat.loss.{loss}"},
        "distributed": {"strategy": strategy, "cp_size": cp_size, "tp_size": tp_size,
                        "activation_checkpointing": checkpointing, "device": "cpu"},
        "checkpoint": {"enabled": False},
        "logging": {"memory": "tracked", "progress": "plain", "metrics_file": None},
    }
