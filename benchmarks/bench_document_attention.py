"""Packed rows: transformers' dense block-diagonal mask against remat's document-wise attention, side by side.

One small Llama (2 layers, hidden 256, 4 query heads over 2 KV heads, fp32) trains one step (forward + backward) on
packed rows at each length: 2 rows, documents of random lengths around ``--document-tokens`` (each row cut
differently; ``position_ids`` restart at each document). Per length and attention:

- tracked peak: the step under `remat.memory.LiveTensorTracker` (exact live tensor bytes created in the step) and
  the largest single allocation (the dense mask is ``rows x T x T`` booleans);
- time: forward + backward, interleaved over ``--rounds`` rounds (each round runs both attentions, in alternating
  order), reported as medians and as the ratio document-wise / dense measured in the same rounds.

Both attentions give the same loss (checked to 1e-5 per length). Results go to
``benchmarks/results/document_attention.{md,json}``.

    OMP_NUM_THREADS=2 python benchmarks/bench_document_attention.py                  # lengths 2048 and 8192
    python benchmarks/bench_document_attention.py --lengths 1024,4096 --rounds 3 --note "quick look"
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.memory import LiveTensorTracker
from remat.models.document_attention import use_document_attention

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = 2
VOCAB = 1024


def _model() -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                  max_position_embeddings=1 << 20)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()


def packed_batch(length: int, document_tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``ROWS`` rows of ``length`` tokens cut into documents of 1 to 2 x ``document_tokens`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    position_ids = torch.empty(ROWS, length, dtype=torch.long)
    for row in range(ROWS):
        at = 0
        while at < length:
            size = min(int(torch.randint(1, 2 * document_tokens + 1, (), generator=generator)), length - at)
            position_ids[row, at:at + size] = torch.arange(size)
            at += size
    input_ids = torch.randint(0, VOCAB, (ROWS, length), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids, "position_ids": position_ids}


def _step(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def _tracked(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[int, int, float]:
    largest = [0]

    def listener(event: str, serial: int, nbytes: int, category: str) -> None:
        if event == "alloc":
            largest[0] = max(largest[0], nbytes)

    with LiveTensorTracker(listener=listener) as tracker:
        loss = _step(model, batch)
    return tracker.peak_bytes, largest[0], loss


def measure(lengths: Sequence[int], document_tokens: int, rounds: int) -> list[dict[str, Any]]:
    dense = _model()
    document = _model()
    use_document_attention(document, True, packed=True)
    models = {"dense mask": dense, "document-wise": document}
    rows = []
    for length in lengths:
        batch = packed_batch(length, document_tokens)
        tracked = {name: _tracked(model, batch) for name, model in models.items()}
        losses = [loss for _, _, loss in tracked.values()]
        if abs(losses[0] - losses[1]) > 1e-5:
            raise SystemExit(f"losses differ at {length} tokens: {losses}")
        times: dict[str, list[float]] = {name: [] for name in models}
        for round_ in range(rounds):
            order = list(models) if round_ % 2 == 0 else list(reversed(models))
            for name in order:
                start = time.perf_counter()
                _step(models[name], batch)
                times[name].append(time.perf_counter() - start)
        ratios = [d / m for d, m in zip(times["document-wise"], times["dense mask"], strict=True)]
        for name in models:
            peak, largest, loss = tracked[name]
            rows.append({"tokens_per_row": length, "rows": ROWS, "attention": name, "peak_bytes": peak,
                         "largest_allocation_bytes": largest, "median_seconds": statistics.median(times[name]),
                         "seconds": times[name], "loss": loss,
                         "time_ratio_to_dense": statistics.median(ratios) if name == "document-wise" else 1.0})
    return rows


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def write(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    lines = [
        "# Packed rows: dense block-diagonal mask vs document-wise attention (CPU)",
        "",
        f"Command: `{command}`",
        "",
        (f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
         f"{torch.get_num_threads()} threads; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC. "
         f"Llama, 2 layers, hidden 256, 4 heads / 2 KV heads, fp32, {ROWS} rows, documents of 1 to "
         f"{2 * args.document_tokens} tokens; one forward + backward. Peak: `LiveTensorTracker` (tensors created in "
         f"the step). Time: median of {args.rounds} interleaved runs; ratio: median of per-round ratios."),
        "",
    ]
    if args.note:
        lines += [f"Note: {args.note}", ""]
    lines += ["| tokens per row | attention | tracked peak | largest allocation | median time | time ratio |",
              "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['tokens_per_row']:,} | {row['attention']} | {_mib(row['peak_bytes'])} | "
                     f"{_mib(row['largest_allocation_bytes'])} | {row['median_seconds']:.3f} s | "
                     f"{row['time_ratio_to_dense']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,8192", help="tokens per row, comma-separated")
    parser.add_argument("--document-tokens", type=int, default=256, help="mean document length")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--note", default="")
    parser.add_argument("--out", type=Path, default=RESULTS / "document_attention",
                        help="output path without suffix (.md and .json are written)")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = measure(lengths, args.document_tokens, args.rounds)
    command = "python benchmarks/bench_document_attention.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    text = write(rows, args, command.strip())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
