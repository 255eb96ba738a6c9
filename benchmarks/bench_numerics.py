"""What the numerics guard costs on the CPU, side by side with what it guards.

For a Llama-shaped model (default: hidden 768, 12 layers, vocab 32000: 134M parameters) with AdamW state, fused and
not: the median time of ``optimizer.step()`` vs the guarded step (`remat.recipes.run_safety.numerics.nonfinite_flag` +
`step_unless`), interleaved, and of the check run before every checkpoint save
(`remat.recipes.run_safety.numerics.non_finite_tensors` over parameters and optimizer state). On a GPU the guarded step adds no
host sync with a fused optimizer (``found_inf``); that is by construction and not measured here.

    .venv/bin/python benchmarks/bench_numerics.py
    .venv/bin/python benchmarks/bench_numerics.py --hidden 256 --layers 4 --repeats 3 --out /tmp/numerics
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from remat.distributed import DistributedSetup
from remat.recipes.run_safety.numerics import non_finite_tensors, nonfinite_flag, step_unless


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(model: torch.nn.Module, fused: bool, repeats: int) -> dict[str, float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    optimizer.step()  # creates the state
    setup = DistributedSetup()
    loss, norm = torch.tensor(2.0), torch.tensor(1.0)
    variants: dict[str, Callable[[], object]] = {
        "optimizer.step": optimizer.step,
        "guarded step": lambda: step_unless(optimizer, nonfinite_flag(loss, norm, setup)),
        "save check": lambda: non_finite_tensors(model, optimizer),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(repeats):
        order = list(variants) if index % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(timed(variants[name]))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "numerics")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                         num_attention_heads=max(args.hidden // 64, 1), vocab_size=args.vocab)
    model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    rows = {f"fused={fused}": measure(model, fused, args.repeats) for fused in (False, True)}
    meta = {"parameters": params, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "load_average": os.getloadavg(),
            "repeats": args.repeats}
    lines = [f"# Numerics guard cost, CPU ({params / 1e6:.1f}M parameters + AdamW state; median of {args.repeats}, "
             f"interleaved; torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
             f"{meta['load_average'][0]:.1f})", "",
             "| optimizer | optimizer.step | guarded step (flag + step_unless) | save check (params + state) |",
             "|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| AdamW {name} | {row['optimizer.step'] * 1e3:.0f} ms | {row['guarded step'] * 1e3:.0f} ms | "
                     f"{row['save check'] * 1e3:.0f} ms |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
