"""What each torchrun worker of the distributed tests runs: ``python dist_worker.py MODE OUT_DIR``.

Modes: ``parity`` trains every case of ``PARITY_CASES`` and records losses, gradient norms, validation and how the
parameters are sharded; ``resume`` trains a run straight, and the same run crashing after its step-4 checkpoint and
resumed, for fsdp2 and ddp. Each rank writes ``<mode>_rank<r>.json`` into OUT_DIR; the tests read and judge them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_recipes import PARITY_CASES, tiny_recipe

from remat.recipes.finetune import FinetuneRecipe, RunResult
from remat.recipes.loader import validate_recipe


def train(recipe: dict[str, Any], callbacks: list[Any] | None = None) -> tuple[FinetuneRecipe, RunResult]:
    job = FinetuneRecipe(validate_recipe(recipe), callbacks=callbacks)
    return job, job.run()


def curve(result: RunResult) -> dict[str, Any]:
    return {"loss": [r.loss for r in result.records], "grad_norm": [r.grad_norm for r in result.records],
            "tokens": [r.num_label_tokens for r in result.records], "mem": [r.mem_bytes for r in result.records],
            "validation": result.validation, "steps": [r.step for r in result.records]}


def shards(job: FinetuneRecipe) -> dict[str, list[Any]]:
    """name -> [local numel, full numel, placements] of every parameter (placements empty for plain tensors)."""
    out = {}
    for name, param in job.model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        out[name] = [local.numel(), param.numel(), [str(p) for p in getattr(param, "placements", ())]]
    return out


def parity(out: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, (strategy, checkpointing, fused, tied, tp_size) in PARITY_CASES.items():
        job, result = train(tiny_recipe(out / name, strategy=strategy, checkpointing=checkpointing, fused=fused,
                                        tied=tied, tp_size=tp_size))
        report[name] = {**curve(result), "shards": shards(job), "blocks": len(job.dist.plan or ())}
    return report


class Crash(RuntimeError):
    """A simulated failure in the middle of a run (after a checkpoint was saved)."""


def crash_at(step: int) -> Any:
    def callback(job: FinetuneRecipe, record: Any) -> None:
        if record.step == step:
            raise Crash(f"simulated crash at step {step}")
    return callback


def resume(out: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for strategy in ("fsdp2", "ddp"):
        def recipe(name: str) -> dict[str, Any]:
            return tiny_recipe(out / name, strategy=strategy, checkpointing="full", fused=strategy == "fsdp2",
                               max_steps=6, step_scheduler={"ckpt_every_steps": 2, "val_every_steps": 3},
                               checkpoint={"enabled": True, "keep_last": 3})

        _, straight = train(recipe(f"{strategy}-straight"))
        try:
            train(recipe(f"{strategy}-crashed"), callbacks=[crash_at(5)])
            raise AssertionError("the crash callback did not fire")
        except Crash:
            pass
        before = json.loads((out / f"{strategy}-crashed" / "metrics.jsonl").read_text().splitlines()[0]) \
            if dist.get_rank() == 0 else None
        job, resumed = train(recipe(f"{strategy}-crashed"))
        report[strategy] = {"straight": curve(straight), "resumed": curve(resumed),
                            "resumed_from": str(job.resumed_from), "first_metrics_row": before}
    return report


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    report = {"parity": parity, "resume": resume}[mode](out)
    (out / f"{mode}_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
