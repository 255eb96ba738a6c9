"""Activation-checkpointing policies side by side on a ~20M-parameter Llama: memory, recompute FLOPs, step time.

For each policy (and transformers' own ``activation_checkpointing_enable()`` as a comparison row) one copy of the
same model and an AdamW optimizer are prepared. Then, all in one run:

- memory: one training step under `remat.memory.LiveTensorTracker` (exact live tensor bytes, parameters, gradients
  and optimizer state included): the activation bytes still held after forward, and the step's peak;
- FLOPs: forward + backward under ``torch.utils.flop_counter.FlopCounterMode``; what exceeds the no-checkpointing
  count is recompute;
- time: fwd + bwd + AdamW steps, interleaved over rounds (every round runs every policy once, in a rotated order),
  reported as medians and as ratios to no checkpointing measured in the same rounds.

Results go to ``benchmarks/results/policies.{md,json}`` with the machine they ran on.

    python benchmarks/bench_policies.py                       # the default ~20M model, seq 512, batch 4
    python benchmarks/bench_policies.py --rounds 3 --note "preliminary: shared machine"
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from remat.checkpointing import apply_activation_checkpointing
from remat.checkpointing.hf_native import enable_hf_checkpointing
from remat.memory import LiveTensorTracker

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HF_ROW = "transformers activation_checkpointing_enable()"

#: (label, policy) rows in table order; `None` marks the transformers comparison row.
POLICIES: tuple[tuple[str, Any], ...] = (
    ("none", "none"),
    ("full", "full"),
    ("selective", "selective"),
    ("attention", "attention"),
    ("mlp", "mlp"),
    ("every_n_layers=2", {"mode": "full", "every_n_layers": 2}),
    ("sqrt", "sqrt"),
    ("offload", "offload"),
    (HF_ROW, None),
)


@dataclass
class Row:
    """What was measured for one policy."""

    label: str
    plan: str
    activation_bytes_after_forward: int = 0
    peak_bytes: int = 0
    flops: int = 0
    step_seconds: list[float] = field(default_factory=list)
    first_loss: float = 0.0

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.step_seconds)


@dataclass
class Candidate:
    label: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    row: Row


def build_model(args: argparse.Namespace) -> nn.Module:
    """The benchmark's Llama, built from a config with fixed-seed weights (nothing downloaded), dropout off."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config)
    return model.train()


def hf_checkpointing(model: nn.Module) -> str:
    """transformers' own checkpointing of every decoder layer (non-reentrant), under the method name this
    transformers has (`remat.checkpointing.hf_native`); returns the plan in words."""
    name = enable_hf_checkpointing(model)
    model.config.use_cache = False
    return f"transformers {name}(): every decoder layer (non-reentrant), input embeddings require grad"


def prepare(label: str, policy: Any, base: nn.Module) -> Candidate:
    model = copy.deepcopy(base)
    if policy is None:
        plan = hf_checkpointing(model)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = apply_activation_checkpointing(model, policy).summary()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return Candidate(label, model, optimizer, Row(label=label, plan=plan))


def train_step(candidate: Candidate, ids: torch.Tensor, on_forward: Callable[[], None] | None = None) -> float:
    """One fwd + bwd + AdamW step; returns the loss."""
    candidate.optimizer.zero_grad(set_to_none=True)
    loss = candidate.model(input_ids=ids, labels=ids, use_cache=False).loss
    if on_forward is not None:
        on_forward()
    loss.backward()
    candidate.optimizer.step()
    return loss.detach().item()


def measure_memory(candidate: Candidate, ids: torch.Tensor) -> None:
    """Activation bytes after forward and the step's peak (parameters, gradients, AdamW state included)."""
    candidate.row.first_loss = train_step(candidate, ids)  # creates the optimizer state: later steps are steady
    candidate.optimizer.zero_grad(set_to_none=True)
    with LiveTensorTracker(module=candidate.model, optimizer=candidate.optimizer) as tracker:
        tracker.mark("start")
        train_step(candidate, ids, on_forward=lambda: tracker.mark("after_forward"))
    candidate.row.activation_bytes_after_forward = tracker.marks["after_forward"] - tracker.marks["start"]
    candidate.row.peak_bytes = tracker.peak_bytes


def measure_flops(candidate: Candidate, ids: torch.Tensor) -> None:
    """FLOPs of forward + backward (matmuls and attention, as torch's counter counts them)."""
    candidate.optimizer.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as counter:
        candidate.model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    candidate.row.flops = counter.get_total_flops()
    candidate.optimizer.zero_grad(set_to_none=True)


def time_interleaved(candidates: Sequence[Candidate], ids: torch.Tensor, rounds: int) -> None:
    """Every round times one step of every candidate, starting one candidate later each round."""
    for candidate in candidates:
        train_step(candidate, ids)  # warm-up
    n = len(candidates)
    for r in range(rounds):
        for k in range(n):
            candidate = candidates[(r + k) % n]
            start = time.perf_counter()
            train_step(candidate, ids)
            candidate.row.step_seconds.append(time.perf_counter() - start)


def machine() -> dict[str, Any]:
    """The machine the numbers come from."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": "cpu",
    }
    try:
        info["load_average_at_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def render_markdown(rows: Sequence[Row], meta: dict[str, Any]) -> str:
    """The results table with the machine, shapes and how to read it."""
    base = next(r for r in rows if r.label == "none")
    m = meta["machine"]
    shape = meta["shape"]
    lines = ["# Activation-checkpointing policies, side by side", ""]
    if meta.get("note"):
        lines += [meta["note"], ""]
    lines += [
        f"- Machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), torch {m['torch']}, "
        f"Python {m['python']}, device {m['device']}; load average at start {m.get('load_average_at_start')}",
        f"- Model: Llama, {shape['params'] / 1e6:.1f}M parameters (hidden {shape['hidden']}, "
        f"MLP {shape['intermediate']}, {shape['layers']} layers, {shape['heads']} heads, vocab {shape['vocab']}, "
        "tied embeddings), fp32, dropout off",
        f"- Step: batch {shape['batch']} x seq {shape['seq']}, forward + backward + AdamW; time = median of "
        f"{meta['rounds']} interleaved rounds; {meta['date']}",
        "- Memory from `LiveTensorTracker` (exact live tensor bytes): *activations after forward* = bytes held when "
        "backward starts minus those held before the step; *peak* = the whole step's peak including parameters, "
        "gradients and AdamW state.",
        "- FLOPs from `FlopCounterMode` over forward + backward; the excess over `none` is recompute.",
        "",
        "| policy | activations after fwd (MiB) | vs none | step peak (MiB) | vs none | FLOPs (G) | vs none "
        "| median step (s) | vs none |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.label} | {_mib(r.activation_bytes_after_forward)} | "
            f"{r.activation_bytes_after_forward / base.activation_bytes_after_forward:.2f} | {_mib(r.peak_bytes)} | "
            f"{r.peak_bytes / base.peak_bytes:.2f} | {r.flops / 1e9:.4g} | {r.flops / base.flops:.2f} | "
            f"{r.median_seconds:.3f} | {r.median_seconds / base.median_seconds:.2f} |"
        )
    lines += ["", "Plans:", ""]
    lines += [f"- `{r.label}`: {r.plan}" for r in rows]
    lines += [
        "",
        "On a CPU-only machine `offload` moves nothing (host memory is the memory): its row shows the cost of the "
        "hooks only. Its benefit needs a GPU.",
        "",
    ]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--note", default="", help="a line put at the top of the markdown (e.g. 'preliminary')")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for policies.md / policies.json")
    parser.add_argument("--name", default="policies", help="file name stem of the results")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    base = build_model(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    candidates = [prepare(label, policy, base) for label, policy in POLICIES]
    for candidate in candidates:
        measure_memory(candidate, ids)
        measure_flops(candidate, ids)
        print(f"measured {candidate.label}", file=sys.stderr, flush=True)
    losses = {c.label: c.row.first_loss for c in candidates}
    if len(set(losses.values())) != 1:
        raise AssertionError(f"policies changed the first loss: {losses}")
    time_interleaved(candidates, ids, args.rounds)

    rows = [c.row for c in candidates]
    meta = {
        "machine": machine(),
        "shape": {
            "params": sum(p.numel() for p in base.parameters()), "hidden": args.hidden,
            "intermediate": args.intermediate, "layers": args.layers, "heads": args.heads, "vocab": args.vocab,
            "seq": args.seq, "batch": args.batch,
        },
        "rounds": args.rounds,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "note": args.note,
    }
    markdown = render_markdown(rows, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(markdown)
    payload = {**meta, "rows": [asdict(r) | {"median_seconds": r.median_seconds} for r in rows]}
    (args.out / f"{args.name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
