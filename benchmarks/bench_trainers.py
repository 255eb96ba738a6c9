"""The same Hugging Face Trainer run side by side: plain, with HF's own activation checkpointing, and with remat
(fixed policies, ``auto`` at two budgets, the fused loss): each step's peak memory, the FLOPs a step counts (so the
recompute each row adds over the plain one) and the median step time, in one run.

On the CPU (the default) a tiny Llama (hidden 256, 4 layers, vocabulary 8192) trains on batch 4 x 512, float32; the
peak is the tracker's (`remat.memory.StepMemoryMeter`: exact tensor bytes), times are medians of the steps after the
first, rows run in turn. ``--device cuda`` runs the seed shape (Llama-3.2-1B config with random weights, batch
8 x 2048, bf16 autocast) with the CUDA allocator's peak and `use_liger_kernel=True` as the anchor row (needs
liger-kernel; not run yet: no GPU was lent while this was written).

    .venv/bin/python benchmarks/bench_trainers.py                  # CPU, writes benchmarks/results/trainers_cpu.*
    python benchmarks/bench_trainers.py --device cuda              # GPU, writes benchmarks/results/trainers_cuda.*
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import remat
from remat.memory import StepMemoryMeter

GIB = 2**30


@dataclass(frozen=True)
class Shape:
    config: dict[str, Any]
    batch: int
    seq: int
    steps: int
    bf16: bool


SHAPES: dict[str, Shape] = {
    "cpu": Shape({"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "vocab_size": 8192}, batch=4, seq=512, steps=10, bf16=False),
    "cuda": Shape({"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
                   "tie_word_embeddings": True}, batch=8, seq=2048, steps=6, bf16=True),
}


@dataclass
class Row:
    name: str
    peaks: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    flops: int = 0
    losses: list[float] = field(default_factory=list)
    note: str = ""


class StepProbe(TrainerCallback):
    """Each step's peak (`StepMemoryMeter`: the allocator's on CUDA, the tracker's on the CPU) and wall time."""

    def __init__(self, row: Row) -> None:
        self.row, self.meter = row, StepMemoryMeter()
        self._stack = contextlib.ExitStack()
        self._start = 0.0

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                      **kwargs: Any) -> None:
        self._stack.enter_context(self.meter.step(model=model, optimizer=getattr(optimizer, "optimizer", optimizer)))
        self._start = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.row.times.append(time.perf_counter() - self._start)
        self._stack.close()
        self.row.peaks.append(self.meter.last.peak_bytes)


def dataset(shape: Shape) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(shape.batch * (shape.steps + 1)):
        ids = torch.randint(0, shape.config["vocab_size"], (shape.seq,), generator=generator)
        rows.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
    return rows


def trainer_for(shape: Shape, work: Path, steps: int, **arguments: Any) -> Trainer:
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=shape.seq, **shape.config)
    model = LlamaForCausalLM(config)
    if torch.cuda.is_available():
        model = model.cuda()
    args = TrainingArguments(output_dir=str(work), per_device_train_batch_size=shape.batch, max_steps=steps,
                             learning_rate=1e-4, logging_steps=1, report_to=[], save_strategy="no", seed=0,
                             disable_tqdm=True, bf16=shape.bf16, use_cpu=not torch.cuda.is_available(), **arguments)
    return Trainer(model=model, args=args, train_dataset=dataset(shape))


Prepare = Callable[[Trainer], str]


def run_row(name: str, shape: Shape, work: Path, prepare: Prepare, **arguments: Any) -> Row:
    """Train ``shape.steps`` steps (peaks, times, losses), then count one step's FLOPs in a fresh Trainer."""
    row = Row(name)
    trainer = trainer_for(shape, work / "run", shape.steps, **arguments)
    row.note = prepare(trainer)
    trainer.add_callback(StepProbe(row))
    trainer.train()
    row.losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    del trainer
    counted = trainer_for(shape, work / "flops", 1, **arguments)
    prepare(counted)
    counter = FlopCounterMode(display=False)
    with counter:
        counted.train()
    row.flops = counter.get_total_flops()
    return row


def remat_prepare(policy: Any, **options: Any) -> Prepare:
    def prepare(trainer: Trainer) -> str:
        plan = remat.prepare_trainer(trainer, policy, **options)
        policy_of = getattr(plan, "policy", None)
        return policy_of.describe() if policy_of is not None else ""
    return prepare


def nothing(trainer: Trainer) -> str:
    return ""


def hf_checkpointing_arguments() -> dict[str, Any]:
    """HF's own switch: ``activation_checkpointing`` in transformers 5.2x, ``gradient_checkpointing`` before."""
    fields = TrainingArguments.__dataclass_fields__
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {name: True, f"{name}_kwargs": {"use_reentrant": False}}


def run(device: str, out: Path) -> dict[str, Any]:
    shape = SHAPES[device]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows.append(run_row("plain", shape, work, nothing))
        rows.append(run_row("HF activation_checkpointing=True", shape, work, nothing, **hf_checkpointing_arguments()))
        if device == "cuda":
            rows.append(run_row("HF use_liger_kernel=True", shape, work, nothing, use_liger_kernel=True))
        rows.append(run_row("remat full", shape, work, remat_prepare("full")))
        rows.append(run_row("remat selective", shape, work, remat_prepare("selective")))
        none_peak, full_peak = max(rows[0].peaks), max(rows[-2].peaks)
        for share in (2 / 3, 1 / 3):
            budget = int(full_peak + share * (none_peak - full_peak))
            rows.append(run_row(f"remat auto @ {budget / GIB:.3g} GiB", shape, work,
                                remat_prepare("auto", memory_budget=budget, target=device)))
        rows.append(run_row("remat fused loss (no checkpointing)", shape, work, remat_prepare("none", loss="fused")))
        rows.append(run_row("remat selective + fused loss", shape, work, remat_prepare("selective", loss="fused")))
    plain = rows[0]
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"{platform.machine()} CPU, {os.cpu_count()} cores",
        "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "shape": {"config": shape.config, "batch": shape.batch, "seq": shape.seq, "steps": shape.steps,
                  "bf16": shape.bf16},
        "rows": [{"name": r.name, "plan": r.note, "peak_bytes": max(r.peaks), "peak_gib": round(max(r.peaks) / GIB, 4),
                  "step_flops": r.flops, "recompute_flops": r.flops - plain.flops,
                  "median_step_s": statistics.median(r.times[1:]), "losses": r.losses} for r in rows],
    }
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"trainers_{device}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# The HF Trainer with and without remat ({device})", "",
             f"{result['date']}; {result['device']}, torch {result['torch']}, {result['threads']} thread(s); Llama "
             f"hidden {shape.config['hidden_size']}, {shape.config['num_hidden_layers']} layers, vocabulary "
             f"{shape.config['vocab_size']}; batch {shape.batch} x {shape.seq}; {'bf16' if shape.bf16 else 'fp32'}; "
             f"{shape.steps} steps per row (median step time of steps 2-{shape.steps}). Peak: "
             f"{'the CUDA allocator' if device == 'cuda' else 'the tracker (exact tensor bytes)'}, the highest step. "
             "FLOPs: one step counted by torch.utils.flop_counter. Produced by benchmarks/bench_trainers.py.", "",
             "| row | plan | peak GiB | x plain | recompute GFLOP | step s | x plain |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    base_peak, base_time = max(plain.peaks), statistics.median(plain.times[1:])
    for r in result["rows"]:
        lines.append(f"| {r['name']} | {r['plan']} | {r['peak_gib']:.3f} | {r['peak_bytes'] / base_peak:.2f} | "
                     f"{r['recompute_flops'] / 1e9:.1f} | {r['median_step_s']:.3f} | "
                     f"{r['median_step_s'] / base_time:.2f} |")
    if device == "cpu":
        lines += ["", "Step times on a 2-core CPU drift between rows run minutes apart (e.g. remat full and HF's own full "
                  "checkpointing recompute the same FLOPs); the peaks and the FLOPs are exact and the comparison to "
                  "read."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    run(args.device, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
