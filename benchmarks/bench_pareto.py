"""On one CUDA GPU: memory against step time at the seed shape, remat's policies and ``auto`` beside every peer.

Issue #34's acceptance run (`benchmarks/gpu_acceptance.sh pareto`): Llama-3.2-1B shape, batch 8 x 2048, bf16, AdamW,
one process, every row built from the same seeded weights by the recipe's own build and step
(`bench_estimate_cuda.build_step`, `remat.recipes.step.train_step`). Rows, in this order (the most telling first, so
that a run stopped by its time budget still answers the issue's questions):

1. remat ``none`` with its fused loss (the backend ``auto`` measures and picks), with Liger's kernel forced, and with
   the plain loss;
2. remat's uniform policies with the fused loss (attention, mlp, selective, full, full every 2nd block); each one
   also runs one step under `remat.planner.measure.count_ops`, and the extra time over ``none`` against the extra
   FLOPs and memory-bound bytes fits the device's rates (`remat.planner.calibration.make_calibration`, as
   ``remat profile --write-calibration`` does);
3. remat ``auto`` at each budget (default 12, 16, 20, 28 GiB), planned with those rates: the planner's predicted peak
   and predicted step time (``none``'s measured step plus the plan's recompute and host-copy seconds) beside the
   measured ones;
4. remat ``full`` with its block inputs offloaded;
5. peers: transformers' checkpointing + Liger, torch's selective checkpointing (``create_selective_checkpoint_contexts``,
   TorchTitan-like op list), transformers' checkpointing with ``offload=True`` + Liger, TRL's activation offloading
   with transformers' checkpointing (TRL's defaults) + Liger;
6. compiled: remat ``full`` with each block compiled (the recipe's ``compile: {enabled: true}``), and
   ``torch.compile`` per block with the partitioner's ``activation_memory_budget`` 0.3 and 0.1 (no checkpointing);
7. remat ``auto`` with compiled blocks at each budget (``auto, compiled blocks @ ...``), planned on blocks the planner
   simulates compiled (`remat.estimate.compiled`), predicted from ``none, compiled blocks``' step.

Per row: ``--warmup`` steps, one step between ``reset_peak_memory_stats`` and ``max_memory_allocated`` (the peak),
``--steps`` timed steps (the median). A row that fails is recorded with its error and the others go on; a row that
would start after ``--budget-seconds`` is skipped and said so. The Markdown and JSON are rewritten after every row
(a run stopped early keeps what it measured); the chart (peak against step time, every row, the budgets as lines) is
drawn at the end. For each budget the summary names the fastest row that fits it and says whether it is remat's.

Writes ``pareto_<device>.{md,json,png}`` under ``--out`` (default benchmarks/results/). Without a CUDA device it
says so and exits with status 2; ``--check-on-cpu`` runs the same code on the CPU with a tiny preset (peaks from the
exact live-tensor tracker, budgets between the measured ``full`` and ``none`` peaks) for the test suite.

    python benchmarks/bench_pareto.py                                   # the acceptance run, ~6-8 minutes on an H200
    python benchmarks/bench_pareto.py --budgets 16GiB,24GiB --rows 'none;full;auto'
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import json
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark modules, however this is started
from bench_estimate_cuda import RealStep, build_step  # noqa: E402
from bench_gpu import (Result, _fmt, enable_torch_selective, report_header, run_timed,  # noqa: E402
                       add_step_arguments, measuring_device, run_meta, shape_defaults)
from bench_policies import hf_checkpointing  # noqa: E402

from remat.checkpointing.budget import parse_budget  # noqa: E402
from remat.estimate.api import resolve_model  # noqa: E402
from remat.estimate.settings import StepSettings  # noqa: E402
from remat.planner.calibration import Calibration, TimingSample, make_calibration  # noqa: E402
from remat.planner.measure import FLOP_FORMULAS, count_ops  # noqa: E402
from remat.planner.planner import Planner  # noqa: E402
from remat.recipes.config import CompileConfig  # noqa: E402
from remat.units import format_bytes  # noqa: E402

GIB = 2**30
BUDGETS = ("12GiB", "16GiB", "20GiB", "28GiB")
#: The uniform policies the device's rates are fitted from (label, remat policy).
UNIFORM = (("attention", "attention"), ("mlp", "mlp"), ("selective", "selective"), ("full", "full"),
           ("full every 2nd", {"mode": "full", "every_n_layers": 2}))


@dataclasses.dataclass
class Row(Result):
    """One measured setting (`bench_gpu.Result`): also whose it is (``remat`` or ``peer``), and for ``auto`` rows
    the budget and the planner's predictions."""

    owner: str = "remat"
    budget_bytes: int | None = None
    """``auto`` rows: the budget planned for."""
    predicted_peak_bytes: int | None = None
    predicted_seconds: float | None = None
    flops: int | None = None
    """Uniform rows: the FLOPs of one step (count_ops), for the fit."""
    memory_bytes: int | None = None

    @property
    def peak_gib(self) -> float | None:
        return self.peak_bytes / GIB if self.peak_bytes else None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "profile"} | {
            "median_seconds": self.median_seconds}


@dataclasses.dataclass
class Spec:
    """How to build one row: a remat policy and loss, then optional changes to the built step."""

    label: str
    owner: str
    policy: Any = "none"
    loss: str = "fused"
    apply: Callable[[RealStep], tuple[RealStep, str]] | None = None
    """Changes the built step (a peer's checkpointing or offloading); returns it and the plan in words."""
    compile: CompileConfig | None = None
    memory_budget: float | None = None
    """``torch._functorch.config.activation_memory_budget`` while the row runs (compiled rows)."""
    count: bool = False
    budget_bytes: int | None = None


# --- the peers ------------------------------------------------------------------------------------------------------


def _hf(step: RealStep) -> tuple[RealStep, str]:
    return step, hf_checkpointing(step.net)


def _hf_offload(step: RealStep) -> tuple[RealStep, str]:
    """transformers' checkpointing with ``offload=True`` (the saved block inputs in pinned host memory), under the
    method name this transformers has."""
    model = step.net
    name = ("activation_checkpointing_enable" if hasattr(model, "activation_checkpointing_enable")
            else "gradient_checkpointing_enable")
    method = getattr(model, name)
    if "offload" not in inspect.signature(method).parameters:
        raise RuntimeError(f"this transformers' {name}() has no offload argument")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        method(offload=True)
    model.config.use_cache = False
    return step, f"transformers {name}(offload=True): every decoder layer, its inputs in pinned host memory"


def _trl_offload(step: RealStep) -> tuple[RealStep, str]:
    """TRL's ``activation_offloading=True`` as SFTTrainer sets it up (its context around the step, the output head
    left out), with transformers' checkpointing as TRL's ``gradient_checkpointing=True`` default turns it on."""
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    hf_checkpointing(step.net)
    on_cuda = next(step.net.parameters()).is_cuda
    context = get_act_offloading_ctx_manager(step.net, use_pin_memory=on_cuda, use_streams=on_cuda)
    inner = step.run

    def run() -> Any:
        with context:
            return inner()

    return step._replace(run=run), ("TRL get_act_offloading_ctx_manager (streams, pinned memory) + transformers' "
                                    "checkpointing of every decoder layer")


def _torch_sac(step: RealStep) -> tuple[RealStep, str]:
    return step, enable_torch_selective(step.net)


def specs(args: argparse.Namespace, wanted: Callable[[str], bool]) -> list[Spec]:
    """The rows before ``auto`` (which needs the fitted rates) and after it, in order; ``auto`` rows are made in
    `run`."""
    compiled = CompileConfig(enabled=True)
    rows = [Spec("none", "remat", "none", "fused", count=True),
            Spec("none + Liger's fused loss", "peer", "none", "fused:liger"),
            Spec("none + plain loss", "remat", "none", "plain"),
            *(Spec(label, "remat", policy, "fused", count=True) for label, policy in UNIFORM)]
    later = [Spec("full, block inputs offloaded", "remat", {"mode": "full", "offload": True}),
             Spec("transformers checkpointing + Liger", "peer", "none", "fused:liger", apply=_hf),
             Spec("torch selective checkpointing (TorchTitan ops)", "peer", "none", "fused", apply=_torch_sac),
             Spec("transformers checkpointing offload=True + Liger", "peer", "none", "fused:liger", apply=_hf_offload),
             Spec("TRL activation offloading + transformers checkpointing + Liger", "peer", "none", "fused:liger",
                  apply=_trl_offload),
             Spec("full, compiled blocks", "remat", "full", compile=compiled),
             *(Spec(f"{mode}, compiled blocks", "remat", mode, compile=compiled)
               for mode in ("none", "attention", "mlp", "selective")),
             Spec("torch.compile activation_memory_budget=0.3", "peer", "none", compile=compiled, memory_budget=0.3),
             Spec("torch.compile activation_memory_budget=0.1", "peer", "none", compile=compiled, memory_budget=0.1)]
    return [s for s in rows if wanted(s.label)] + [s for s in later if wanted(s.label)]


# --- measuring ------------------------------------------------------------------------------------------------------


def settings_for(args: argparse.Namespace, device: torch.device, policy: Any, loss: str,
                 compile: CompileConfig | None = None) -> StepSettings:
    name, _, backend = loss.partition(":")
    return StepSettings(batch_size=args.batch, seq_length=args.seq, dtype=args.dtype, policy=policy, loss=name,
                        loss_kwargs={"backend": backend} if backend else {}, target=device.type,
                        compile=compile.model_dump(mode="json") if compile is not None else None)


@contextlib.contextmanager
def _row_context(spec: Spec) -> Iterator[None]:
    """The partitioner's ``activation_memory_budget`` for a compiled peer row. The partitioner prices recompute with
    torch's FLOP counter, which before torch 2.13 refuses grouped-query attention (``sdpa_flop_count: query/key/value
    shapes are incompatible``, torch 2.11 on an H200): remat's formulas for it are registered for the row, so that
    the peer runs at all."""
    if spec.memory_budget is None:
        yield
        return
    import torch._functorch.config as functorch_config
    from torch.utils import flop_counter

    formulas = {op: formula if getattr(formula, "_get_raw", False) else flop_counter.shape_wrapper(formula)
                for op, formula in FLOP_FORMULAS.items()}
    with functorch_config.patch(activation_memory_budget=spec.memory_budget), \
            mock.patch.dict(flop_counter.flop_registry, formulas):
        yield


def measure(spec: Spec, args: argparse.Namespace, device: torch.device) -> Row:
    """Build the row's step, warm up, measure the peak, time ``args.steps`` steps (and count one, for the fit)."""
    row = Row(label=spec.label, owner=spec.owner, loss=spec.loss, tokens_per_step=args.batch * args.seq,
              budget_bytes=spec.budget_bytes)
    step: RealStep | None = None
    try:
        with _row_context(spec):
            step = build_step(args.preset, settings_for(args, device, spec.policy, spec.loss), device,
                              compile=spec.compile)
            words = f"remat {spec.policy!r}: {step.plan or 'nothing checkpointed'}"
            if spec.apply is not None:
                step, words = spec.apply(step)
            row.plan = words + ("; each block compiled (inductor)" if spec.compile is not None else "") + (
                f", activation_memory_budget {spec.memory_budget}" if spec.memory_budget is not None else "")
            row.peak_bytes, row.step_seconds = run_timed(step, device, args.warmup, args.steps)
            if spec.count:
                with count_ops() as counter:
                    step.run()
                counts = counter.counts()
                row.flops, row.memory_bytes = counts.flops, counts.memory_bytes
    except Exception as err:  # a row that fails is a finding, not the end of the run
        traceback.print_exc()
        row.error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
        row.step_seconds.clear()
    finally:
        del step
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if spec.compile is not None:
            torch._dynamo.reset()
    return row


def fit_rates(rows: Sequence[Row], device: torch.device) -> Calibration | None:
    """The device's recompute rates from the counted uniform rows (None when ``none`` or every other is missing)."""
    samples = [TimingSample(r.label, r.median_seconds, r.flops, r.memory_bytes or 0) for r in rows
               if r.flops is not None and r.median_seconds is not None]
    if not any(s.label == "none" for s in samples) or len(samples) < 2:
        return None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return make_calibration(samples, device=name, target=device.type, torch_version=torch.__version__)


def auto_specs(args: argparse.Namespace, device: torch.device, calibration: Calibration | None,
               budgets: Sequence[int], compile: CompileConfig | None = None) -> tuple[list[Spec], dict[str, Any]]:
    """One ``auto`` row per budget, planned with the fitted rates (for blocks compiled as ``compile`` says, when
    given: the planner simulates them compiled); and each row's plan (or the error planning raised, as text), by
    label."""
    rates = {} if calibration is None else {"flops_per_second": calibration.flops_per_second,
                                            "memory_bytes_per_second": calibration.memory_bytes_per_second}
    planner = Planner.from_settings(resolve_model(args.preset), settings_for(args, device, "none", "fused", compile),
                                    **rates)
    rows, plans = [], {}
    for budget in budgets:
        label = f"{AUTO_COMPILED if compile is not None else 'auto'} @ {format_bytes(budget)}"
        try:
            plan = planner.plan(budget)
        except Exception as err:
            plans[label] = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:300]}"
            continue
        plans[label] = plan
        rows.append(Spec(label, "remat", plan.policy.to_dict(), "fused", budget_bytes=budget, compile=compile))
    return rows, plans


AUTO_COMPILED: Final[str] = "auto, compiled blocks"
"""The label (before `` @ budget``) of the ``auto`` rows planned for and run with compiled blocks."""


# --- the report -----------------------------------------------------------------------------------------------------


def verdicts(rows: Sequence[Row], budgets: Sequence[int]) -> list[str]:
    """Per budget: the fastest row that fits it, remat's fastest, and auto's time against the fastest."""
    lines = ["| budget | fastest row that fits | its step s | remat's fastest | its step s | auto's step s | "
             "auto vs fastest | auto's step s, compiled blocks | vs fastest |",
             "|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for budget in budgets:
        fits = [r for r in rows if r.median_seconds is not None and r.peak_bytes and r.peak_bytes <= budget]
        if not fits:
            lines.append(f"| {format_bytes(budget)} | nothing measured fits | | | | | | | |")
            continue
        best = min(fits, key=lambda r: r.median_seconds or 0.0)
        mine = [r for r in fits if r.owner == "remat"]
        remat_best = min(mine, key=lambda r: r.median_seconds or 0.0) if mine else None
        cells = []
        for prefix in ("auto @ ", f"{AUTO_COMPILED} @ "):
            auto = next((r for r in rows if r.budget_bytes == budget and r.label.startswith(prefix)
                         and r.median_seconds is not None), None)
            auto_fits = auto is not None and auto.peak_bytes is not None and auto.peak_bytes <= budget
            ratio = (auto.median_seconds / best.median_seconds if auto is not None and auto.median_seconds
                     and best.median_seconds else None)
            cells.append(f"{_fmt(auto.median_seconds if auto else None, '.3f')}"
                         f"{'' if auto is None or auto_fits else ' (over)'} | {_fmt(ratio, '.3f')}")
        lines.append(f"| {format_bytes(budget)} | {best.label} | {_fmt(best.median_seconds, '.3f')} | "
                     f"{remat_best.label if remat_best else '-'} | "
                     f"{_fmt(remat_best.median_seconds if remat_best else None, '.3f')} | {' | '.join(cells)} |")
    return lines


def render(rows: Sequence[Row], meta: dict[str, Any], budgets: Sequence[int], plans: dict[str, Any],
           calibration: Calibration | None) -> str:
    base = next((r for r in rows if r.label == "none" and r.median_seconds), None)
    lines = [*report_header(f"Memory against step time on {meta['device']}", meta, "bench_pareto.py",
                            "`vs none` = against remat `none` with its fused loss"),
             "| row | whose | loss | peak GiB | step s | vs none | tokens/s | predicted peak GiB | predicted step s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.error is not None:
            lines.append(f"| {r.label} | {r.owner} | {r.loss} | {r.error} | | | | | |")
            continue
        ratio = r.median_seconds / base.median_seconds if base and r.median_seconds else None
        tps = r.tokens_per_step / r.median_seconds if r.median_seconds else None
        lines.append(f"| {r.label} | {r.owner} | {r.loss} | {_fmt(r.peak_gib, '.2f')} | "
                     f"{_fmt(r.median_seconds, '.3f')} | {_fmt(ratio, '.2f')} | {_fmt(tps, ',.0f')} | "
                     f"{_fmt(r.predicted_peak_bytes / GIB if r.predicted_peak_bytes else None, '.2f')} | "
                     f"{_fmt(r.predicted_seconds, '.3f')} |")
    lines += ["", "## At each budget", "", *verdicts(rows, budgets), ""]
    if calibration is not None:
        lines += [f"Rates fitted from the uniform rows (`{calibration.method}`): {calibration.describe()}.", ""]
    lines += ["## Plans", ""]
    for label, plan in plans.items():
        lines.append(f"- {label}: {plan if isinstance(plan, str) else plan.summary()}")
    lines += [f"- `{r.label}`: {r.plan}" for r in rows if r.plan]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], budgets: Sequence[int], meta: dict[str, Any], path: Path) -> Path | None:
    """Peak against step time, every measured row; remat's policies, its auto plans and the peers apart."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(10, 6.5))
    styles = {"remat": ("tab:blue", "o"), "auto": ("tab:red", "*"), "peer": ("tab:gray", "s")}
    for r in rows:
        if r.median_seconds is None or not r.peak_bytes:
            continue
        kind = "auto" if r.budget_bytes is not None else r.owner
        color, marker = styles[kind]
        ax.scatter(r.peak_bytes / GIB, r.median_seconds, c=color, marker=marker, s=140 if kind == "auto" else 60,
                   zorder=3)
        ax.annotate(r.label, (r.peak_bytes / GIB, r.median_seconds), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    for budget in budgets:
        ax.axvline(budget / GIB, color="tab:red", linestyle=":", linewidth=0.8)
    for kind, (color, marker) in styles.items():
        ax.scatter([], [], c=color, marker=marker, label={"remat": "remat policies", "auto": "remat auto (budget "
                                                          "lines dotted)", "peer": "peers"}[kind])
    ax.set_xlabel("peak memory (GiB, max_memory_allocated)")
    ax.set_ylabel("step time (s, median)")
    ax.set_title(f"{meta['preset']}, {meta['batch']} x {meta['seq']}, {meta['dtype']} on {meta['device']} "
                 f"(torch {meta['torch']})", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(rows: Sequence[Row], meta: dict[str, Any], out: Path, budgets: Sequence[int], plans: dict[str, Any],
          calibration: Calibration | None, *, chart: bool = False) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "_" for c in meta["device"].lower()).strip("_")
    stem = out / f"pareto_{slug}"
    plan_data = {label: (p if isinstance(p, str) else p.to_dict()) for label, p in plans.items()}
    stem.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "budgets": list(budgets), "calibration": calibration.to_dict() if calibration else None,
         "plans": plan_data, "rows": [r.to_dict() for r in rows]}, indent=2) + "\n")
    stem.with_suffix(".md").write_text(render(rows, meta, budgets, plans, calibration))
    if chart:
        plot(rows, budgets, meta, stem.with_suffix(".png"))
    return stem.with_suffix(".md")


# --- the run --------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, device: torch.device, meta: dict[str, Any]) -> list[Row]:
    start = time.perf_counter()
    rows: list[Row] = []
    plans: dict[str, Any] = {}
    calibration: Calibration | None = None
    budgets = list(args.budgets or [])

    def wanted(label: str) -> bool:
        return not args.rows or any(label == w or label.startswith(w + " ") for w in args.rows)

    def one(spec: Spec) -> None:
        left = args.budget_seconds - (time.perf_counter() - start)
        if left <= 0:
            rows.append(Row(label=spec.label, owner=spec.owner, loss=spec.loss, budget_bytes=spec.budget_bytes,
                            error=f"skipped: the run's {args.budget_seconds:.0f} s were spent"))
        else:
            rows.append(measure(spec, args, device))
        r = rows[-1]
        print(f"[{time.perf_counter() - start:6.1f} s] {r.label} ({r.loss}): " + (r.error or (
            f"peak {r.peak_gib:.2f} GiB, median {r.median_seconds:.3f} s")), file=sys.stderr, flush=True)
        write(rows, meta, args.out, budgets, plans, calibration)

    before, after = [], []
    for spec in specs(args, wanted):
        (before if spec.count or spec.label.startswith("none") else after).append(spec)
        # the rows after the fit: the counted uniform rows and the none rows come first
    for spec in before:
        one(spec)
    calibration = fit_rates(rows, device)
    if not budgets:  # the CPU check: budgets between the measured full and none peaks
        peaks = {r.label: r.peak_bytes for r in rows if r.peak_bytes}
        if "none" in peaks and "full" in peaks:
            budgets = [peaks["full"] + (peaks["none"] - peaks["full"]) // 2, peaks["none"] + peaks["none"] // 10]
    def auto_rows(compile: CompileConfig | None, base_label: str) -> None:
        try:
            auto, planned = auto_specs(args, device, calibration, budgets, compile)
        except Exception as err:
            traceback.print_exc()
            auto, planned = [], {f"{AUTO_COMPILED if compile else 'auto'} @ {format_bytes(b)}":
                                 f"{type(err).__name__}: {err}" for b in budgets}
        plans.update(planned)
        base = next((r for r in rows if r.label == base_label and r.median_seconds), None)
        for spec in auto:
            one(spec)
            plan = planned[spec.label]
            rows[-1].predicted_peak_bytes = plan.peak_bytes
            if base is not None:  # compiled rows: recompute priced at the eager rates (docs/planner.md)
                rows[-1].predicted_seconds = base.median_seconds + plan.recompute_seconds + plan.transfer_seconds

    if wanted("auto") and budgets:
        auto_rows(None, "none")
    for spec in after:
        one(spec)
    if wanted(AUTO_COMPILED) and budgets:
        auto_rows(CompileConfig(enabled=True), "none, compiled blocks")
    write(rows, meta, args.out, budgets, plans, calibration, chart=True)
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_arguments(parser)
    parser.add_argument("--budgets", default=None,
                        help=f"comma-separated sizes auto plans for (default {','.join(BUDGETS)}; with "
                             "--check-on-cpu, between the measured full and none peaks)")
    parser.add_argument("--rows", type=lambda text: [x.strip() for x in text.split(";") if x.strip()], default=[],
                        help="only rows whose label is, or starts with, one of these (';'-separated; 'auto' for "
                             "the auto rows); default every row")
    parser.add_argument("--budget-seconds", type=float, default=450.0,
                        help="start no row after this many seconds (default 450)")
    args = parser.parse_args(argv)
    shape_defaults(args)
    if args.budgets is None and not args.check_on_cpu:
        args.budgets = ",".join(BUDGETS)
    if args.budgets is not None:
        try:
            args.budgets = [parse_budget(b.strip(), device_bytes=None, key="--budgets")
                            for b in args.budgets.split(",") if b.strip()]
        except Exception as err:
            parser.error(str(err))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = measuring_device(args, "bench_pareto")
    if device is None:
        return 2
    meta = run_meta(args, device, argv)
    run(args, device, meta)
    slug = "".join(c if c.isalnum() else "_" for c in meta["device"].lower()).strip("_")
    path = args.out / f"pareto_{slug}.md"
    print(path.read_text())
    print(f"wrote {path} and its .json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
