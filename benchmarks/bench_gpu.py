"""On a CUDA GPU: every checkpointing policy side by side, with the plain and the fused loss, at the seed shape.

Rows (one process, one after the other, each from the same seeded weights): remat's policies (``bench_policies.
POLICIES``: none, full, selective, attention, mlp, every 2 layers, sqrt, offload), transformers' own checkpointing
(``activation_checkpointing_enable``, or ``gradient_checkpointing_enable`` on older transformers) and torch's public
selective checkpointing (``create_selective_checkpoint_contexts`` around each decoder layer, with an op list like
TorchTitan's: save matmuls except every second one, attention and max, recompute the rest). Each row runs with remat's
plain loss (``MaskedCrossEntropy`` on logits) and with its fused loss (``FusedLinearCrossEntropy``).

The step is the recipe's (`remat.recipes.step.train_step`: forward, backward, clipping, AdamW), built by
``bench_estimate_cuda.build_step`` from a remat preset. Per row: ``--warmup`` steps, then one step between
``reset_peak_memory_stats`` and ``max_memory_allocated`` (the peak), then ``--steps`` timed steps (each between
``torch.cuda.synchronize`` calls): median step time and tokens/s. A row that is refused (an error naming why) or runs
out of memory is recorded as such and the others go on.

Writes ``benchmarks/results/gpu_policies_<device>.{md,json}`` naming the device and the torch version. Without a CUDA
device it says so and exits with status 2. ``--check-on-cpu`` runs the same code on the CPU with a tiny preset (peak
from the exact live-tensor tracker) so the test suite can keep it working.

    python benchmarks/bench_gpu.py                                        # llama-3.2-1b, 8 x 2048, bf16, AdamW
    python benchmarks/bench_gpu.py --batch 2 --seq 1024 --preset qwen3-0.6b
    python benchmarks/bench_gpu.py --profile selective,torch-sac       # + where one step of each spends its time

``--long-context`` measures instead the long-context settings (`LONG_ROWS`: full + tiled + offloaded inputs, and
full + tiled, both with the fused loss) at batch 1 and growing lengths (``--lengths``, default 512k, 768k, 1M
tokens): one step per length and row, its peak and its own time (no warm-up: a first step, whose peak includes the
optimizer state's creation), as many as fit in ``--budget-seconds`` (a length is skipped when the last step's time,
scaled by the square of the length ratio for attention, would overrun it; a row that ran out of memory skips the
longer lengths). Writes ``gpu_long_context_<device>.{md,json}``. One command, within a 10-minute limit:

    python benchmarks/bench_gpu.py --long-context                         # llama-3.2-1b, bf16, 512k tokens and on
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark modules, however this is started
from bench_estimate_cuda import RealStep, build_step  # noqa: E402
from bench_policies import POLICIES, hf_checkpointing  # noqa: E402

from remat.errors import CheckpointingError, ConfigError  # noqa: E402
from remat.memory import LiveTensorTracker  # noqa: E402
from remat.estimate.settings import StepSettings  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TORCH_SAC = "torch-sac"
TORCH_SAC_ROW = "torch create_selective_checkpoint_contexts (TorchTitan-like ops)"
#: (label, what to apply): a remat policy, None for transformers' checkpointing, TORCH_SAC for torch's.
ROWS: tuple[tuple[str, Any], ...] = (*POLICIES, (TORCH_SAC_ROW, TORCH_SAC))
LOSSES = ("plain", "fused")
#: --losses also takes the fused loss with one backend forced ("fused:torch", "fused:liger", "fused:cce"): the step's
#: time with each, side by side (plain "fused" is the default backend choice).
FUSED_BACKENDS = ("torch", "liger", "cce")
GIB = 2**30
#: --long-context rows: (label, remat policy), each with the fused loss.
LONG_ROWS: tuple[tuple[str, Any], ...] = (
    ("full + tiled + offload", {"mode": "full", "tiled": True, "tile_tokens": 2048, "offload": True}),
    ("full + tiled", {"mode": "full", "tiled": True, "tile_tokens": 2048}),
)
LONG_LENGTHS = (524288, 786432, 1048576)


@dataclasses.dataclass
class Result:
    """One row x loss: what ran and what it measured (``error`` set instead when it could not run)."""

    label: str
    loss: str
    plan: str = ""
    peak_bytes: int | None = None
    step_seconds: list[float] = dataclasses.field(default_factory=list)
    tokens_per_step: int = 0
    error: str | None = None
    profile: str | None = None
    """With ``--profile``: torch.profiler's table of one more step (self CPU time first), for the rows named."""

    @property
    def median_seconds(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None

    @property
    def tokens_per_second(self) -> float | None:
        median = self.median_seconds
        return self.tokens_per_step / median if median else None


def _torch_selective_context() -> Any:
    """Fresh selective-checkpoint contexts for one checkpointed call: matmuls saved except every second one (counted
    separately in forward and in recompute, so both make the same choices), attention kernels and max saved."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "max")
    save = {getattr(aten, name).default for name in names if hasattr(aten, name)} | {aten.mm.default}
    matmuls = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op == aten.mm.default:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def enable_torch_selective(model: nn.Module) -> str:
    """Wrap every decoder layer of a transformers model in a non-reentrant checkpoint with torch's selective
    contexts (as TorchTitan does); returns the plan in words."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = model.get_decoder().layers
    for index, layer in enumerate(layers):
        layers[index] = checkpoint_wrapper(layer, context_fn=_torch_selective_context)
    return f"torch selective checkpointing of {len(layers)} decoder layers (save mm except every 2nd, attention, max)"


def _plan(step: RealStep, what: Any) -> str:
    if what is None:
        return hf_checkpointing(step.net)
    if what == TORCH_SAC:
        return enable_torch_selective(step.net)
    return f"remat {what!r}: {step.plan or 'nothing checkpointed'}"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(step: RealStep, device: torch.device) -> int:
    """The peak of one step: the CUDA allocator's, or the exact tracked peak on the CPU."""
    if device.type == "cpu":
        with LiveTensorTracker(module=step.root, optimizer=step.optimizer) as tracker:
            step.run()
        return tracker.peak_bytes
    _synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step.run()
    _synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def measure(label: str, what: Any, loss: str, args: argparse.Namespace, device: torch.device) -> Result:
    """Build the step of one row, warm up, measure the peak, then time ``args.steps`` steps."""
    result = Result(label=label, loss=loss, tokens_per_step=args.batch * args.seq)
    remat_policy = "none" if what is None or what == TORCH_SAC else what
    loss_name, _, backend = loss.partition(":")
    settings = StepSettings(batch_size=args.batch, seq_length=args.seq, dtype=args.dtype, policy=remat_policy,
                            loss=loss_name, loss_kwargs={"backend": backend} if backend else {}, target=device.type)
    step: RealStep | None = None
    try:
        step = build_step(args.preset, settings, device)
        result.plan = _plan(step, what)
        result.peak_bytes, result.step_seconds = run_timed(step, device, args.warmup, args.steps)
        if loss == args.losses[0] and _profiled(label, args.profile):
            result.profile = _profile_step(step, device)
    except (torch.cuda.OutOfMemoryError, CheckpointingError, ConfigError) as err:
        result.error = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
        result.step_seconds.clear()
    finally:
        del step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return result


def run_timed(step: RealStep, device: torch.device, warmup: int, steps: int) -> tuple[int, list[float]]:
    """``warmup`` untimed steps, one step whose peak is measured (`_peak`), then ``steps`` timed steps, each between
    synchronisations; returns the peak and the step times (with ``steps`` 0, the measured step's own time)."""
    for _ in range(warmup):
        step.run()
    _synchronize(device)
    start = time.perf_counter()
    peak = _peak(step, device)
    seconds = [time.perf_counter() - start] if steps == 0 else []
    for _ in range(steps):
        _synchronize(device)
        start = time.perf_counter()
        step.run()
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return peak, seconds


def _profiled(label: str, wanted: Sequence[str]) -> bool:
    return label in wanted or (label == TORCH_SAC_ROW and TORCH_SAC in wanted)


def _profile_step(step: RealStep, device: torch.device) -> str:
    """One more step under torch.profiler: where its time goes, by op, self CPU time first (the host-side cost of a
    policy shows there; the CUDA columns say what the GPU did meanwhile)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as profiler:
        step.run()
        _synchronize(device)
    wall = time.perf_counter() - start
    averages = profiler.key_averages()
    tables = [f"step under the profiler: {wall:.3f} s wall; "
              f"{sum(e.count for e in averages):,} op calls", "",
              "by self CPU time:", averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    if device.type == "cuda":
        tables += ["by self CUDA time:", averages.table(sort_by="self_device_time_total", row_limit=25)]
    return "\n".join(str(t) for t in tables)


def run(args: argparse.Namespace, device: torch.device,
        report: Callable[[Result], None] = lambda r: None) -> list[Result]:
    """Every row with every loss, one after the other."""
    results = []
    for label, what in ROWS:
        if args.rows and label not in args.rows and not (what == TORCH_SAC and TORCH_SAC in args.rows):
            continue
        for loss in args.losses:
            results.append(measure(label, what, loss, args, device))
            report(results[-1])
    return results


def run_long_context(args: argparse.Namespace, device: torch.device,
                     report: Callable[[Result], None] = lambda r: None) -> list[Result]:
    """`LONG_ROWS` at batch 1 and each of ``args.lengths``, one measured step each, within ``args.budget_seconds``
    (see the module docstring)."""
    results: list[Result] = []
    start = time.perf_counter()
    failed: set[str] = set()
    last: tuple[int, float] | None = None  # (length, seconds) of the last step that ran
    for length in args.lengths:
        for label, policy in LONG_ROWS:
            if label in failed:
                continue
            left = args.budget_seconds - (time.perf_counter() - start)
            if last is not None and last[1] * (length / last[0]) ** 2 > left:
                results.append(Result(label=label, loss="fused", tokens_per_step=length,
                                      error=f"skipped: {left:.0f} s of the budget left, a step of {length:,} tokens "
                                            f"would take about {last[1] * (length / last[0]) ** 2:.0f} s"))
                report(results[-1])
                continue
            row = argparse.Namespace(**{**vars(args), "batch": 1, "seq": length, "warmup": 0, "steps": 0})
            result = measure(label, policy, "fused", row, device)
            results.append(result)
            report(result)
            if result.error is not None:
                failed.add(label)
            elif result.step_seconds:
                last = (length, result.step_seconds[0])
    return results


def render_long_context(results: Sequence[Result], meta: dict[str, Any]) -> str:
    """One row per (length, setting): the peak and the step time."""
    lines = [f"# Long context on {meta['device']}", "",
             f"- {meta['preset']}, batch 1, {meta['dtype']}, AdamW, fused loss; torch {meta['torch']}, transformers "
             f"{meta['transformers']}, Python {meta['python']}; {meta['date']}",
             "- one step per row (no warm-up: the first step, whose peak includes creating AdamW's state); peak = "
             "`max_memory_allocated`, step time = that step, synchronised",
             "- command: `python benchmarks/bench_gpu.py " + " ".join(meta["argv"]) + "`", "",
             "| tokens | setting | peak GiB | step s | tokens/s |", "|---:|---|---:|---:|---:|"]
    for r in results:
        if r.error is not None:
            lines.append(f"| {r.tokens_per_step:,} | {r.label} | {r.error} | | |")
            continue
        lines.append(f"| {r.tokens_per_step:,} | {r.label} | {_fmt(r.peak_bytes / GIB if r.peak_bytes else None, '.2f')}"
                     f" | {_fmt(r.median_seconds, '.1f')} | {_fmt(r.tokens_per_second, ',.0f')} |")
    lines += ["", "Plans:", ""]
    lines += [f"- `{r.label}` at {r.tokens_per_step:,} tokens: {r.plan}" for r in results if r.plan]
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report_header(title: str, meta: dict[str, Any], script: str, ratios: str) -> list[str]:
    """A results file's title and what it measured, how and with which command (``ratios``: what they compare)."""
    return [f"# {title}", "",
            f"- {meta['preset']}, batch {meta['batch']} x seq {meta['seq']}, {meta['dtype']}, AdamW; torch "
            f"{meta['torch']}, transformers {meta['transformers']}, Python {meta['python']}; {meta['date']}",
            f"- peak = `max_memory_allocated` of one step after {meta['warmup']} warm-up steps; step time = median of "
            f"{meta['steps']} steps (synchronised); {ratios}",
            f"- command: `python benchmarks/{script} " + " ".join(meta["argv"]) + "`", ""]


def render_markdown(results: Sequence[Result], meta: dict[str, Any]) -> str:
    """The side-by-side table; ratios are to ``none`` with the same loss."""
    base = {r.loss: r for r in results if r.label == "none"}
    lines = [*report_header(f"Checkpointing policies on {meta['device']}", meta, "bench_gpu.py",
                            "ratios are to `none` with the same loss"),
             "| row | loss | peak GiB | vs none | median step s | vs none | tokens/s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        ref = base.get(r.loss)
        if r.error is not None:
            lines.append(f"| {r.label} | {r.loss} | {r.error} | | | | |")
            continue
        peak_ratio = r.peak_bytes / ref.peak_bytes if ref is not None and ref.peak_bytes else None
        time_ratio = (r.median_seconds / ref.median_seconds if ref is not None and ref.median_seconds
                      and r.median_seconds else None)
        lines.append(f"| {r.label} | {r.loss} | {_fmt(r.peak_bytes / GIB if r.peak_bytes else None, '.2f')} | "
                     f"{_fmt(peak_ratio, '.2f')} | {_fmt(r.median_seconds, '.3f')} | {_fmt(time_ratio, '.2f')} | "
                     f"{_fmt(r.tokens_per_second, ',.0f')} |")
    lines += ["", "Plans:", ""]
    first = results[0].loss if results else None
    lines += [f"- `{r.label}` ({r.loss}): {r.plan}" for r in results if r.loss == first]
    return "\n".join(lines) + "\n"


def write(results: Sequence[Result], meta: dict[str, Any], out: Path, *, long_context: bool = False) -> Path:
    """``gpu_policies_<device>.md`` (``gpu_long_context_<device>.md`` with ``long_context``) and ``.json`` in
    ``out``; returns the markdown's path."""
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "_" for c in meta["device"].lower()).strip("_")
    stem = out / f"{'gpu_long_context' if long_context else meta.get('stem', 'gpu_policies')}_{slug}"
    rows = [{k: v for k, v in dataclasses.asdict(r).items() if k != "profile"}
            | {"median_seconds": r.median_seconds, "tokens_per_second": r.tokens_per_second} for r in results]
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    render = render_long_context if long_context else render_markdown
    stem.with_suffix(".md").write_text(render(results, meta))
    profiled = [r for r in results if r.profile]
    if profiled:
        lines = [f"# One step under torch.profiler on {meta['device']}", "", f"torch {meta['torch']}; "
                 f"{meta['preset']}, batch {meta['batch']} x {meta['seq']}, {meta['dtype']}; "
                 f"loss {profiled[0].loss}.", ""]
        for r in profiled:
            lines += [f"## {r.label}", "", "```", r.profile or "", "```", ""]
        (out / f"gpu_profile_{slug}.md").write_text("\n".join(lines))
    return stem.with_suffix(".md")


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The step's shape, the warm-up and timed steps, ``--out`` and ``--check-on-cpu`` (`shape_defaults` fills the
    shape in; bench_pareto.py shares them)."""
    parser.add_argument("--preset", default=None, help="remat model preset (default llama-3.2-1b; tiny-llama with "
                                                        "--check-on-cpu)")
    parser.add_argument("--batch", type=int, default=None, help="rows per step (default 8; 2 with --check-on-cpu)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default 2048; 64 with --check-on-cpu)")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                        help="parameter dtype (default bfloat16; float32 with --check-on-cpu)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before measuring")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (the median is reported)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--check-on-cpu", action="store_true",
                        help="run the same code on the CPU with a tiny preset (for the test suite)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser)
    parser.add_argument("--long-context", action="store_true",
                        help="measure the long-context rows (LONG_ROWS) at batch 1 and --lengths instead")
    parser.add_argument("--lengths", type=lambda text: [int(x) for x in text.split(",")], default=None,
                        help="with --long-context: comma-separated tokens per row (default 524288,786432,1048576; "
                             "256,512 with --check-on-cpu)")
    parser.add_argument("--budget-seconds", type=float, default=540.0,
                        help="with --long-context: stop starting steps that would end after this (default 540)")
    parser.add_argument("--profile", type=lambda text: [x.strip() for x in text.split(",") if x.strip()],
                        default=[], metavar="ROWS",
                        help="after a row's timed steps, run one more under torch.profiler and write its table to "
                             "gpu_profile_<device>.md: row labels, comma-separated (torch-sac for torch's own "
                             "selective row), e.g. selective,torch-sac; the plain loss's rows")
    parser.add_argument("--stem", default="gpu_policies",
                        help="the results' file name before _<device> (default gpu_policies)")
    parser.add_argument("--rows", type=lambda text: [x.strip() for x in text.split(";") if x.strip()], default=[],
                        metavar="ROWS", help="only these rows: labels separated by ';' (torch-sac for torch's own "
                                             "selective row); default every row")
    parser.add_argument("--losses", type=lambda text: [x.strip() for x in text.split(",") if x.strip()],
                        default=list(LOSSES), metavar="LOSSES",
                        help="comma-separated: plain, fused, or fused:BACKEND (" + ", ".join(FUSED_BACKENDS) +
                             ") to force one fused-loss backend; default plain,fused")
    args = parser.parse_args(argv)
    allowed_losses = {*LOSSES, *(f"fused:{b}" for b in FUSED_BACKENDS)}
    if not args.losses or set(args.losses) - allowed_losses:
        parser.error(f"--losses: got {','.join(args.losses)!r}; allowed: comma-separated "
                     f"{', '.join(sorted(allowed_losses))}")
    unknown = sorted(set(args.rows) - {label for label, _ in ROWS} - {TORCH_SAC})
    if unknown:
        parser.error(f"--rows: {', '.join(unknown)} is not a row; allowed: "
                     f"{'; '.join(label for label, _ in ROWS)}; {TORCH_SAC}")
    unknown = sorted(set(args.profile) - {label for label, _ in ROWS} - {TORCH_SAC})
    if unknown:
        parser.error(f"--profile: {', '.join(unknown)} is not a row; allowed: "
                     f"{', '.join(label for label, _ in POLICIES)}, {TORCH_SAC}")
    if args.lengths is None:
        args.lengths = [256, 512] if args.check_on_cpu else list(LONG_LENGTHS)
    return shape_defaults(args)


def shape_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``--preset``/``--batch``/``--seq``/``--dtype`` left unset: the seed shape on a GPU, a tiny one with
    ``--check-on-cpu`` (bench_pareto.py shares these)."""
    for name, gpu_default, cpu_default in (("preset", "llama-3.2-1b", "tiny-llama"), ("batch", 8, 2),
                                           ("seq", 2048, 64), ("dtype", "bfloat16", "float32")):
        if getattr(args, name) is None:
            setattr(args, name, cpu_default if args.check_on_cpu else gpu_default)
    return args


def run_meta(args: argparse.Namespace, device: torch.device, argv: Sequence[str] | None) -> dict[str, Any]:
    """What a result file says of its run: device, versions, shape, steps, command line and date."""
    import transformers

    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "preset": args.preset, "batch": args.batch, "seq": args.seq,
            "dtype": args.dtype, "warmup": args.warmup, "steps": args.steps,
            "argv": list(argv if argv is not None else sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def measuring_device(args: argparse.Namespace, script: str) -> torch.device | None:
    """The device a benchmark measures on (the CPU with ``--check-on-cpu``), with the fused loss's backend choice
    logged; None, after saying so, where no CUDA device is visible."""
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("remat.loss").setLevel(logging.INFO)  # which fused-loss backend ran, and its measured times
    if args.check_on_cpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print(f"{script}: no CUDA device here (torch.cuda.is_available() is False); this benchmark measures on a "
              "GPU. Nothing was run (--check-on-cpu runs the same code on the CPU).", file=sys.stderr)
        return None
    return torch.device("cuda", torch.cuda.current_device())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = measuring_device(args, "bench_gpu")
    if device is None:
        return 2
    meta = run_meta(args, device, argv) | {"stem": args.stem}

    def report(r: Result) -> None:
        figures = r.error or (f"peak {(r.peak_bytes or 0) / GIB:.2f} GiB, median {r.median_seconds:.3f} s, "
                              f"{r.tokens_per_second:,.0f} tokens/s")
        print(f"{r.label} + {r.loss}: {figures}", file=sys.stderr, flush=True)

    if args.long_context:
        meta.update(lengths=args.lengths, budget_seconds=args.budget_seconds)
        results = run_long_context(args, device, report)
    else:
        results = run(args, device, report)
    path = write(results, meta, args.out, long_context=args.long_context)
    print(path.read_text())
    print(f"wrote {path} and {path.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
