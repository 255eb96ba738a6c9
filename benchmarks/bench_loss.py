"""Peak memory and time of the loss forward+backward: the plain loss vs FusedLinearCrossEntropy, side by side.

"plain" is what a model does without the fused loss: ``logits = hidden @ weight.T`` then MaskedCrossEntropy.
"fused" is FusedLinearCrossEntropy with its defaults; "fused-forward" / "fused-recompute" force that grad_strategy;
"fused-compiled" takes the fast path that CUDA uses by default (chunk math compiled by torch.compile, here with the
C++ compiler; the first, untimed run compiles). bench_loss_cuda.py measures on a GPU.

Memory is exact live-tensor accounting (remat.memory.LiveTensorTracker) on the CPU. The hidden states and the
head's weight are held as parameters of a small module, so the tracker files them as "parameters" and their
gradients as "gradients"; the *working* memory of a loss is its peak minus those two (everything the loss itself
allocates: logits, softmax, temporaries, saved tensors). Time is the median over interleaved repeats (the order
alternates every repeat) of one forward+backward, after one warm-up run per variant.

    .venv/bin/python benchmarks/bench_loss.py                  # vocab 32k and 128k, 4096 tokens, hidden 2048
    .venv/bin/python benchmarks/bench_loss.py --vocab 32768 --repeats 5 --out /tmp/loss
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from remat.loss import FusedLinearCrossEntropy, MaskedCrossEntropy
from remat.loss.chunked import FAST_CHUNK_BYTES, auto_token_chunk
from remat.memory import LiveTensorTracker

GIB = 2**30
VARIANTS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "plain": lambda h, w, labels: MaskedCrossEntropy()(F.linear(h, w), labels),
    "fused": lambda h, w, labels: FusedLinearCrossEntropy()(h, w, labels),
    "fused-forward": lambda h, w, labels: FusedLinearCrossEntropy(grad_strategy="forward")(h, w, labels),
    "fused-recompute": lambda h, w, labels: FusedLinearCrossEntropy(grad_strategy="recompute")(h, w, labels),
    "fused-compiled": lambda h, w, labels: FusedLinearCrossEntropy(compile=True)(h, w, labels),
}


class LossInputs(nn.Module):
    """The loss's inputs as parameters (hidden states and head weight) plus HF-convention labels."""

    def __init__(self, batch: int, seq: int, hidden: int, vocab: int, prompt: int, dtype: torch.dtype) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.hidden = nn.Parameter(torch.randn(batch, seq, hidden, generator=generator).to(dtype))
        self.weight = nn.Parameter((torch.randn(vocab, hidden, generator=generator) / hidden**0.5).to(dtype))
        labels = torch.randint(0, vocab, (batch, seq), generator=generator)
        labels[:, :prompt] = -100  # a masked prompt, as in instruction fine-tuning
        self.register_buffer("labels", labels)

    def loss(self, variant: str) -> Tensor:
        return VARIANTS[variant](self.hidden, self.weight, self.labels)


@dataclass
class Row:
    """One variant at one vocabulary size."""

    vocab: int
    variant: str
    peak_bytes: int
    working_bytes: int
    inputs_bytes: int
    gradients_bytes: int
    peak_op: str | None
    flops: int
    median_s: float
    times_s: list[float]
    loss: float
    peak_ratio: float = float("nan")
    working_ratio: float = float("nan")
    time_ratio: float = float("nan")


def measure_memory(inputs: LossInputs, variant: str) -> tuple[LiveTensorTracker, int, float]:
    """One forward+backward under the tracker and a FLOP counter; returns both and the loss value."""
    inputs.zero_grad(set_to_none=True)
    with LiveTensorTracker(module=inputs) as tracker, FlopCounterMode(display=False) as flops:
        loss = inputs.loss(variant)
        loss.backward()
        value = float(loss.detach())
        del loss
    return tracker, flops.get_total_flops(), value


def time_once(inputs: LossInputs, variant: str) -> float:
    inputs.zero_grad(set_to_none=True)
    start = time.perf_counter()
    inputs.loss(variant).backward()
    return time.perf_counter() - start


def bench_vocab(vocab: int, args: argparse.Namespace, dtype: torch.dtype) -> list[Row]:
    batch = max(1, args.tokens // args.seq)
    inputs = LossInputs(batch, args.seq, args.hidden, vocab, args.prompt, dtype)
    rows: dict[str, Row] = {}
    for variant in args.variants:  # also the warm-up run of each variant
        tracker, flops, value = measure_memory(inputs, variant)
        split = tracker.peak_breakdown
        rows[variant] = Row(
            vocab=vocab, variant=variant, peak_bytes=tracker.peak_bytes,
            working_bytes=tracker.peak_bytes - split["parameters"] - split["gradients"],
            inputs_bytes=split["parameters"], gradients_bytes=split["gradients"], peak_op=tracker.peak_op, flops=flops,
            median_s=float("nan"), times_s=[], loss=value,
        )
        print(f"  vocab {vocab} {variant:16s} peak {tracker.peak_bytes / GIB:7.3f} GiB", flush=True)
    for repeat in range(args.repeats):
        order = args.variants if repeat % 2 == 0 else list(reversed(args.variants))
        for variant in order:
            rows[variant].times_s.append(time_once(inputs, variant))
        print(f"  vocab {vocab} repeat {repeat + 1}: "
              + ", ".join(f"{v} {rows[v].times_s[-1]:.2f}s" for v in args.variants), flush=True)
    for row in rows.values():
        row.median_s = statistics.median(row.times_s) if row.times_s else float("nan")
    if "plain" in rows:
        base = rows["plain"]
        for row in rows.values():
            row.peak_ratio = row.peak_bytes / base.peak_bytes
            row.working_ratio = row.working_bytes / base.working_bytes
            row.time_ratio = row.median_s / base.median_s if base.times_s else float("nan")
    return list(rows.values())


def machine_description() -> dict[str, object]:
    """What the numbers were measured on, including how busy the machine was."""
    mem_total = None
    if Path("/proc/meminfo").exists():
        first = Path("/proc/meminfo").read_text().splitlines()[0].split()
        mem_total = f"{int(first[1]) / 2**20:.1f} GiB"
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory": mem_total,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def render_markdown(rows: Sequence[Row], config: dict[str, object], machine: dict[str, object]) -> str:
    lines = [
        "# Loss forward+backward: plain vs fused linear cross-entropy",
        "",
        f"Tokens {config['tokens']} (batch {config['batch']} x seq {config['seq']}, first {config['prompt']} "
        f"tokens of each row prompt-masked), hidden {config['hidden']}, dtype {config['dtype']}, "
        f"{config['repeats']} interleaved timing repeats.",
        f"Machine: {machine['cpu']}, {machine['cpu_count']} cores ({machine['torch_threads']} torch threads), "
        f"{machine['memory']}, torch {machine['torch']}. {config['note']}",
        "",
        "*peak*: exact peak of live tensor bytes, inputs (hidden states, weight) and their gradients included. "
        "*working*: peak minus the inputs and the gradients alive at the peak, i.e. what the loss itself holds. "
        "Ratios are against the plain loss at the same vocabulary.",
        *(["*fused-compiled*: its memory and FLOP columns come from its untimed first run, under the live-tensor "
           "tracker, where torch.compile does not compile (the same math runs eagerly, with fp32 temporaries of the "
           "chunk); its times are the compiled path's."] if "fused-compiled" in config["variants"] else []),
        "",
        "| vocab | loss | chunk | peak GiB | working GiB | working / plain | peak / plain | TFLOP | median s "
        "| time / plain |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        chunks = config["chunks_fast"] if row.variant == "fused-compiled" else config["chunks"]
        chunk = "-" if row.variant == "plain" else str(chunks[str(row.vocab)])
        median, time_ratio = (f"{row.median_s:.2f}", f"{row.time_ratio:.2f}") if row.times_s else ("-", "-")
        lines.append(
            f"| {row.vocab} | {row.variant} | {chunk} | {row.peak_bytes / GIB:.3f} | {row.working_bytes / GIB:.3f} "
            f"| {row.working_ratio:.1%} | {row.peak_ratio:.1%} | {row.flops / 1e12:.2f} | {median} | {time_ratio} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=128, help="prompt-masked tokens at the start of each row")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["plain", "fused"])
    parser.add_argument("--note", default="", help="free text for the results (e.g. how busy the machine was)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "loss",
                        help="writes OUT.md and OUT.json")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    args.seq = min(args.seq, args.tokens)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    machine = machine_description()
    rows: list[Row] = []
    for vocab in args.vocab:
        rows.extend(bench_vocab(vocab, args, dtype))
    machine["load_average_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    config = {
        "tokens": max(1, args.tokens // args.seq) * args.seq, "batch": max(1, args.tokens // args.seq),
        "seq": args.seq, "prompt": args.prompt, "hidden": args.hidden, "dtype": args.dtype, "repeats": args.repeats,
        "chunks": {str(v): min(auto_token_chunk(v, dtype), args.tokens) for v in args.vocab}, "note": args.note,
        "variants": list(args.variants),
        "chunks_fast": {str(v): min(auto_token_chunk(v, dtype, None, FAST_CHUNK_BYTES, fast=True), args.tokens)
                        for v in args.vocab},
    }
    markdown = render_markdown(rows, config, machine)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(markdown)
    payload = {"config": config, "machine": machine, "rows": [asdict(row) for row in rows]}
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    print(markdown)
    return rows


if __name__ == "__main__":
    main()
