"""What each torchrun rank of tests/distributed/test_auto_model.py runs: ``python auto_worker.py OUT CHECKPOINT_DIR``.

For every case of ``CASES``: ``remat.AutoModelForCausalLM.from_pretrained`` with a ``DistributedSetup`` (DDP or
FSDP2, with a checkpointing policy, and context parallelism for the ``cp2`` cases) from a local checkpoint or a
preset, one forward+backward on this rank's half of ``batch()`` (the whole of it under cp_size 2), and a report of the global loss, every parameter's full gradient (norm and sum), what was wrapped and
what came back. Each rank writes ``auto_rank<r>.json`` into OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_recipes import leave_process_group

#: name -> (strategy, source, activation checkpointing[, cp_size]). "checkpoint" is the local directory the test
#: saved. With cp_size 2 both ranks are given the whole batch, and each call's rows are cut to the rank's shard.
CASES: dict[str, tuple[Any, ...]] = {
    "ddp-checkpoint-full": ("ddp", "checkpoint", "full"),
    "fsdp2-checkpoint-full": ("fsdp2", "checkpoint", True),
    "fsdp2-checkpoint-sqrt": ("fsdp2", "checkpoint", "sqrt"),  # 3 blocks: segments 0-1 and 2, sharded as units
    "ddp-preset-selective": ("ddp", "preset", "selective"),
    "fsdp2-preset-full": ("fsdp2", "preset", "full"),
    "ddp-checkpoint-full-cp2": ("ddp", "checkpoint", "full", 2),
    "fsdp2-preset-selective-cp2": ("fsdp2", "preset", "selective", 2),
}
#: Overrides that shrink the tiny-llama preset (keyword arguments of from_pretrained, as transformers takes them).
PRESET_OVERRIDES: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                    "vocab_size": 96}
SEED = 0


def batch(vocab_size: int = 96) -> torch.Tensor:
    """The global batch: 4 rows of 12 tokens (each of 2 ranks takes 2 rows)."""
    return torch.randint(0, vocab_size, (4, 12), generator=torch.Generator().manual_seed(5))


def grad_summary(model: torch.nn.Module) -> dict[str, list[float]]:
    """name -> [norm, sum] of each parameter's full gradient (gathered from its shards under FSDP2)."""
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        out[name] = [grad.norm().item(), grad.sum().item()]
    return out


def run_case(strategy: str, source: str, policy: Any, checkpoint: Path, cp_size: int = 1) -> dict[str, Any]:
    import remat
    from remat.checkpointing.wrappers import STATE_ATTR

    setup = remat.DistributedSetup.build(strategy=strategy, activation_checkpointing=policy, cp_size=cp_size)
    torch.manual_seed(SEED)
    if source == "preset":
        root = remat.AutoModelForCausalLM.from_pretrained("tiny-llama", distributed_setup=setup, **PRESET_OVERRIDES)
    else:
        root = remat.AutoModelForCausalLM.from_pretrained(str(checkpoint), distributed_setup=setup)
    model = root.module if strategy == "ddp" else root
    ids = batch().chunk(setup.dp_size)[setup.dp_rank]
    loss = root(input_ids=ids, labels=ids).loss
    loss.backward()
    total = torch.tensor([loss.item()], dtype=torch.float64)
    dist.all_reduce(total)
    return {"loss": total.item() / 2, "grads": grad_summary(model), "root": type(root).__name__,
            "model": type(model).__name__, "wrapped": sum(hasattr(m, STATE_ATTR) for m in model.modules()),
            "checkpointed": root.remat_plan.num_checkpointed, "same_plan": root.remat_plan is model.remat_plan,
            "segments": [list(s) for s in root.remat_plan.segments]}


def main() -> None:
    out, checkpoint = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    report = {name: run_case(*case[:3], checkpoint, *case[3:]) for name, case in CASES.items()}
    (out / f"auto_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main()
