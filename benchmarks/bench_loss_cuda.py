"""The loss forward+backward on a CUDA device, side by side in one process: plain, remat's torch backend, the kernels.

Rows (``--variants``):

- ``plain``: ``logits = hidden @ weight.T`` then ``MaskedCrossEntropy`` (what a model does without a fused loss).
- ``remat-compiled``: ``FusedLinearCrossEntropy(backend="torch", compile=True)``, the default on CUDA: compiled chunk
  math, "forward" strategy, 768-row chunks at a 128k vocabulary.
- ``remat-eager``: ``compile=False``, ``grad_strategy="auto"``: the eager path (what remat ran on CUDA before the fast
  path; "recompute" for a bf16 weight). ``remat-eager-forward`` / ``remat-eager-recompute`` force the strategy.
- ``cce`` / ``liger``: ``FusedLinearCrossEntropy(backend="cce" | "liger")``, i.e. the kernel packages called through
  remat's adapters; a row says why it was skipped when the package is absent.

Per row: median forward+backward time over ``--repeats`` runs after ``--warmup`` runs (CUDA events; the warm-up also
compiles), working memory = ``torch.cuda.max_memory_allocated()`` during one forward+backward minus what was allocated
before it (the inputs), the matmul throughput (3 matmuls of ``2 * tokens * vocab * hidden`` FLOPs over the median
time) and ratios against cut-cross-entropy and the plain loss. Targets checked for ``remat-compiled``: time at most
1.3x cce and memory at most 1.5x cce, time at most the plain loss's where the plain loss fits.

    python benchmarks/bench_loss_cuda.py                   # 4k, 16k, 64k tokens, hidden 2048, vocab 128256, bf16
    python benchmarks/bench_loss_cuda.py --check-on-cpu    # the same code at a tiny size on the CPU (no numbers)

Writes ``benchmarks/results/loss_cuda.md`` and ``.json`` (device, torch, CUDA, Triton and kernel package versions).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from remat.loss import FusedLinearCrossEntropy, MaskedCrossEntropy
from remat.loss.backends import KernelRequest, select_backend
from remat.memory import LiveTensorTracker

GIB = 2**30
LossFn = Callable[[Tensor, Tensor, Tensor], Tensor]
VARIANTS: dict[str, LossFn] = {
    "plain": lambda h, w, labels: MaskedCrossEntropy()(F.linear(h, w), labels),
    "remat-compiled": FusedLinearCrossEntropy(backend="torch", compile=True),
    "remat-eager": FusedLinearCrossEntropy(backend="torch", compile=False),
    "remat-eager-forward": FusedLinearCrossEntropy(backend="torch", compile=False, grad_strategy="forward"),
    "remat-eager-recompute": FusedLinearCrossEntropy(backend="torch", compile=False, grad_strategy="recompute"),
    "cce": FusedLinearCrossEntropy(backend="cce"),
    "liger": FusedLinearCrossEntropy(backend="liger"),
}
KERNEL_VARIANTS = ("cce", "liger")
TARGETS = {"time_vs_cce": 1.3, "memory_vs_cce": 1.5, "time_vs_plain": 1.0}


@dataclass
class Row:
    """One variant at one token count."""

    tokens: int
    variant: str
    status: str = "ok"  # "ok", "OOM" or "skipped: <why>"
    median_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    working_bytes: int | None = None
    loss: float | None = None
    matmul_tflops: float | None = None
    time_vs_cce: float | None = None
    memory_vs_cce: float | None = None
    time_vs_plain: float | None = None


def make_inputs(tokens: int, seq: int, hidden: int, vocab: int, dtype: torch.dtype,
                device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Hidden states ``[tokens // seq, seq, hidden]`` and head weight as leaves that require grad, and labels."""
    generator = torch.Generator().manual_seed(0)
    batch = max(1, tokens // seq)
    h = torch.randn(batch, seq, hidden, generator=generator).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=generator) / hidden**0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
    return h, w, labels


def skip_reason(variant: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a kernel variant cannot run here (it would silently measure the torch backend otherwise)."""
    if variant not in KERNEL_VARIANTS:
        return None
    request = KernelRequest(dtype, bias=False, softcap=None, hidden_needs_grad=True)
    if select_backend(variant, device, request) != variant:  # type: ignore[arg-type]
        return "skipped: not importable or not on CUDA (see the remat.loss log)"
    return None


def step(fn: LossFn, h: Tensor, w: Tensor, labels: Tensor) -> float:
    """One forward+backward; returns the loss and leaves the inputs without gradients."""
    loss = fn(h, w, labels)
    loss.backward()
    value = float(loss.detach())
    h.grad = w.grad = None
    return value


def working_memory(fn: LossFn, h: Tensor, w: Tensor, labels: Tensor) -> tuple[int, float]:
    """Peak bytes allocated by one forward+backward above what was allocated before it, and the loss."""
    if h.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        value = step(fn, h, w, labels)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, value
    with LiveTensorTracker() as tracker:  # exact live-tensor accounting on the CPU, above what was alive at entry
        value = step(fn, h, w, labels)
    return tracker.peak_bytes, value


def timed(fn: LossFn, h: Tensor, w: Tensor, labels: Tensor) -> float:
    """Milliseconds of one forward+backward (CUDA events on a GPU, wall clock on the CPU)."""
    if h.device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = fn(h, w, labels)
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        h.grad = w.grad = None
        return start.elapsed_time(end)
    begin = time.perf_counter()
    step(fn, h, w, labels)
    return (time.perf_counter() - begin) * 1e3


def measure(variant: str, tokens: int, inputs: tuple[Tensor, Tensor, Tensor], args: argparse.Namespace) -> Row:
    h, w, labels = inputs
    row = Row(tokens, variant)
    reason = skip_reason(variant, h.device, h.dtype)
    if reason:
        row.status = reason
        return row
    fn = VARIANTS[variant]
    try:
        for _ in range(args.warmup):
            step(fn, h, w, labels)
        row.working_bytes, row.loss = working_memory(fn, h, w, labels)
        row.times_ms = [timed(fn, h, w, labels) for _ in range(args.repeats)]
    except torch.OutOfMemoryError:
        h.grad = w.grad = None
        row.status, row.times_ms, row.working_bytes = "OOM", [], None
        return row
    row.median_ms = statistics.median(row.times_ms)
    row.matmul_tflops = 3 * 2 * h[..., 0].numel() * w.shape[0] * w.shape[1] / (row.median_ms * 1e-3) / 1e12
    return row


def add_ratios(rows: list[Row]) -> None:
    """Time and memory against cce and time against plain, at the same token count."""
    by_key = {(row.tokens, row.variant): row for row in rows}
    for row in rows:
        cce, plain = by_key.get((row.tokens, "cce")), by_key.get((row.tokens, "plain"))
        if row.median_ms is None:
            continue
        if cce is not None and cce.median_ms:
            row.time_vs_cce = row.median_ms / cce.median_ms
            row.memory_vs_cce = row.working_bytes / cce.working_bytes if cce.working_bytes else None
        if plain is not None and plain.median_ms:
            row.time_vs_plain = row.median_ms / plain.median_ms


def target_verdicts(rows: list[Row]) -> list[str]:
    """One line per token count: whether remat-compiled met the targets (where the compared row ran)."""
    lines = []
    for row in rows:
        if row.variant != "remat-compiled" or row.median_ms is None:
            continue
        checks = [f"{name} {value:.2f} (target <= {TARGETS[name]}) {'met' if value <= TARGETS[name] else 'MISSED'}"
                  for name in TARGETS if (value := getattr(row, name)) is not None]
        lines.append(f"- {row.tokens} tokens: " + ("; ".join(checks) or "no cce or plain row to compare with"))
    return lines


def environment(device: torch.device) -> dict[str, object]:
    """Device, torch, CUDA, Triton and kernel package versions."""
    def version(distribution: str) -> str | None:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    cuda = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "cuda": torch.version.cuda if cuda else None, "python": platform.python_version(),
        "triton": version("triton"), "cut-cross-entropy": version("cut-cross-entropy"),
        "liger-kernel": version("liger-kernel"),
    }


def render_markdown(rows: Sequence[Row], config: dict[str, object], env: dict[str, object]) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        "# Loss forward+backward on a GPU: plain vs remat vs cut-cross-entropy vs liger",
        "",
        f"Device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}), Triton {env['triton']}, "
        f"cut-cross-entropy {env['cut-cross-entropy']}, liger-kernel {env['liger-kernel']}.",
        f"hidden {config['hidden']}, vocab {config['vocab']}, {config['dtype']}, sequences of {config['seq']} tokens; "
        f"median of {config['repeats']} runs after {config['warmup']} warm-up runs. {config['note']}",
        "",
        *(["**Check run on the CPU at a tiny size (--check-on-cpu): it exercises the script; its numbers measure "
           "nothing.**", ""] if config["check_on_cpu"] else []),
        "*working*: peak allocated during one forward+backward minus what was allocated before (the inputs); the "
        "gradients the loss returns are included. *matmul TFLOP/s*: 3 x 2 x tokens x vocab x hidden / median time.",
        "",
        "| tokens | loss | status | median ms | working GiB | matmul TFLOP/s | time / cce | memory / cce "
        "| time / plain | loss value |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        working = None if row.working_bytes is None else row.working_bytes / GIB
        lines.append(
            f"| {row.tokens} | {row.variant} | {row.status} | {fmt(row.median_ms, '.2f')} | {fmt(working, '.3f')} "
            f"| {fmt(row.matmul_tflops, '.0f')} | {fmt(row.time_vs_cce, '.2f')} | {fmt(row.memory_vs_cce, '.2f')} "
            f"| {fmt(row.time_vs_plain, '.2f')} | {fmt(row.loss, '.5f')} |"
        )
    lines += ["", "Targets for remat-compiled (issue 9):", *target_verdicts(list(rows))]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--note", default="")
    parser.add_argument("--out", type=Path, default=None,
                        help="writes OUT.md and OUT.json (default: benchmarks/results/loss_cuda; with --check-on-cpu a "
                             "temporary folder, so a check never replaces the GPU's results)")
    parser.add_argument("--check-on-cpu", action="store_true",
                        help="run the same code on the CPU at a tiny size (tokens 256/512, hidden 32, vocab 1000, "
                             "float32, 2 repeats) to check the script, not to measure anything")
    args = parser.parse_args(argv)
    if args.check_on_cpu:
        args.tokens, args.seq, args.hidden, args.vocab = [256, 512], 128, 32, 1000
        args.dtype, args.repeats, args.warmup = "float32", 2, 1
    if args.out is None:
        args.out = (Path(tempfile.mkdtemp(prefix="remat-loss-check-")) if args.check_on_cpu
                    else Path(__file__).parent / "results") / "loss_cuda"
    return args


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    if args.check_on_cpu:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        raise SystemExit("bench_loss_cuda.py measures on a CUDA device and torch.cuda.is_available() is False here; "
                         "--check-on-cpu runs the same code at a tiny size on the CPU (a check, not a measurement)")
    dtype = getattr(torch, args.dtype)
    env = environment(device)
    print(f"{env['device']}, torch {env['torch']}", flush=True)
    rows: list[Row] = []
    for tokens in args.tokens:
        inputs = make_inputs(tokens, min(args.seq, tokens), args.hidden, args.vocab, dtype, device)
        for variant in args.variants:
            rows.append(measure(variant, tokens, inputs, args))
            row = rows[-1]
            print(f"  {tokens:6d} {variant:22s} {row.status:8s} median {row.median_ms} ms", flush=True)
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    add_ratios(rows)
    config = {"tokens": args.tokens, "seq": args.seq, "hidden": args.hidden, "vocab": args.vocab,
              "dtype": args.dtype, "repeats": args.repeats, "warmup": args.warmup, "note": args.note,
              "check_on_cpu": args.check_on_cpu}
    markdown = render_markdown(rows, config, env)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(markdown)
    payload = {"config": config, "environment": env, "targets": TARGETS, "rows": [asdict(row) for row in rows]}
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    print(markdown)
    print(f"wrote {args.out.with_suffix('.md')} and .json")
    return rows


if __name__ == "__main__":
    main()
