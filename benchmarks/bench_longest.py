"""How long can the Llama-3.2-1B shape train on 80 GiB, how long `remat estimate --longest` takes to say, and how
far its extrapolation is from direct estimates.

1. Runs ``remat estimate --preset llama-3.2-1b --batch-size 1 --dtype bfloat16 --longest --fits 80GiB --compare``
   as a subprocess and records its wall time and CPU time (the CPU time over 2 is its wall time on an idle 2-core
   machine; the wall time depends on the machine's load, which is recorded too).
2. For full + fused and full + tiled + fused, fits the per-phase lines from the three window samples (as
   ``--longest`` does) and compares the extrapolated peak with a direct estimate at 256k and 512k tokens: the error
   in bytes and in tokens (bytes over the binding line's slope). The tiled direct estimate at 512k takes ~6 minutes
   on an idle core.

Results go to benchmarks/results/longest.{json,md}.

    nice .venv/bin/python benchmarks/bench_longest.py            # ~10-20 minutes on 2 shared cores
    .venv/bin/python benchmarks/bench_longest.py --skip-direct   # only the timed command (3 runs, medians)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

GIB = 2**30
CLI = ["--preset", "llama-3.2-1b", "--batch-size", "1", "--dtype", "bfloat16", "--longest", "--fits", "80GiB",
       "--compare"]
DIRECT_LENGTHS = (262144, 524288)
SETTINGS: dict[str, dict[str, Any]] = {
    "full + fused": {"policy": "full", "loss": "fused"},
    "full + tiled + fused": {"policy": {"mode": "full", "tiled": True}, "loss": "fused"},
}


def _load() -> float:
    """The 1-minute load average (/proc/loadavg's first field): how busy the shared machine was."""
    return round(os.getloadavg()[0], 2)


def time_cli() -> dict[str, Any]:
    """Run the --longest --compare command once; its wall and CPU time (children included), the load average before
    and after it, and its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "longest.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        load = _load()
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "remat.cli", "estimate", *CLI, "--json", str(out)],
                              capture_output=True, text=True, check=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        answers = json.loads(out.read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(done.stdout)
    return {"command": "remat estimate " + " ".join(CLI) + " --json out.json", "wall_seconds": round(wall, 1),
            "cpu_seconds": round(cpu, 1), "load_average_before": load, "load_average_after": _load(),
            "output": done.stdout, "answers": answers}


def _lengths(answers: list[dict[str, Any]]) -> list[tuple[str, int | None, int | None]]:
    """Each row's answer and predicted peak (what must not change between runs; the seconds do)."""
    return [(a["name"], a["longest_seq_length"], a["predicted_peak_bytes"]) for a in answers]


def time_cli_runs(repeat: int) -> dict[str, Any]:
    """`time_cli` ``repeat`` times in a row: the last run's output, every run's times and load, and the medians (the
    machine is shared: one run says little)."""
    runs = [time_cli() for _ in range(repeat)]
    result = dict(runs[-1])
    result["runs"] = [{k: r[k] for k in ("wall_seconds", "cpu_seconds", "load_average_before", "load_average_after")}
                      for r in runs]
    result["wall_seconds"] = round(statistics.median(r["wall_seconds"] for r in runs), 1)
    result["cpu_seconds"] = round(statistics.median(r["cpu_seconds"] for r in runs), 1)
    result["same_answers"] = all(_lengths(r["answers"]) == _lengths(runs[0]["answers"]) for r in runs)
    return result


def direct_rows() -> list[dict[str, Any]]:
    """Per setting: the window lines, and the extrapolated vs the direct peak at each of DIRECT_LENGTHS."""
    from remat.estimate.api import resolve_model
    from remat.estimate.longest import _normalized, _window, fit_lines
    from remat.estimate.sampling import PeakSampler
    from remat.estimate.settings import StepSettings

    model = resolve_model("llama-3.2-1b")
    rows = []
    with PeakSampler(model, jobs=2) as sampler:
        settings = {name: _normalized(model, StepSettings(batch_size=1, dtype="bfloat16", **kw))
                    for name, kw in SETTINGS.items()}
        windows = {name: _window(model, s, 1024, None) for name, s in settings.items()}
        requests = [(s, n) for name, s in settings.items() for n in (*windows[name], *DIRECT_LENGTHS)]
        start = time.perf_counter()
        sampler.many(requests)
        print(f"direct estimates done in {time.perf_counter() - start:.0f} s")
        for name, s in settings.items():
            samples = sampler.many([(s, n) for n in windows[name]])
            lines = fit_lines(samples)
            for length in DIRECT_LENGTHS:
                direct = sampler.one(s, length)
                binding = max(lines, key=lambda ln: ln.at(length))
                extrapolated = binding.at(length)
                error = direct.peak_bytes - extrapolated
                rows.append({
                    "setting": name, "seq_length": length, "window": list(windows[name]),
                    "extrapolated_peak_bytes": int(extrapolated), "direct_peak_bytes": direct.peak_bytes,
                    "error_bytes": int(error), "error_share": round(error / direct.peak_bytes, 5),
                    "error_tokens": round(error / binding.bytes_per_token, 1),
                    "binding_phase": binding.phase, "direct_phase": direct.phase,
                    "bytes_per_token": round(binding.bytes_per_token, 1),
                    "direct_seconds": round(direct.seconds, 1),
                    "window_seconds": [round(x.seconds, 1) for x in samples],
                })
    return rows


def write(cli: dict[str, Any] | None, rows: list[dict[str, Any]], out: Path) -> None:
    meta = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    out.mkdir(parents=True, exist_ok=True)
    (out / "longest.json").write_text(json.dumps({"meta": meta, "cli": cli, "direct": rows}, indent=2) + "\n")
    lines = ["# remat estimate --longest: Llama-3.2-1B shape, batch 1, bf16, AdamW, 80 GiB (estimates, modelled for "
             "a CUDA GPU)", "",
             f"Run on {meta['cpus']} CPU cores ({meta['machine']}), torch {meta['torch']}, {meta['date_utc']} UTC. "
             "All figures are estimates (`remat estimate`), not GPU measurements.", ""]
    if cli:
        runs = cli.get("runs", [cli])
        lines += [f"`{cli['command']}`: median of {len(runs)} run(s) {cli['wall_seconds']} s wall, "
                  f"{cli['cpu_seconds']} s CPU (processes included); per run wall / CPU / load average before-after: "
                  + "; ".join(f"{r['wall_seconds']} s / {r['cpu_seconds']} s / {r['load_average_before']}-"
                              f"{r.get('load_average_after', '?')}" for r in runs),
                  "", "```", cli["output"].rstrip(), "```", ""]
    if rows:
        lines += ["Extrapolated (per-phase lines through the window samples) vs direct estimate:", "",
                  "| setting | tokens | window | extrapolated GiB | direct GiB | error | error in tokens | direct "
                  "estimate took |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            lines.append(f"| {r['setting']} | {r['seq_length']:,} | {'/'.join(f'{n:,}' for n in r['window'])} | "
                         f"{r['extrapolated_peak_bytes'] / GIB:.3f} | {r['direct_peak_bytes'] / GIB:.3f} | "
                         f"{r['error_bytes'] / 2**20:+.1f} MiB ({100 * r['error_share']:+.3f} %) | "
                         f"{r['error_tokens']:+.0f} | {r['direct_seconds']} s |")
        lines.append("")
    (out / "longest.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--skip-cli", action="store_true", help="skip the timed --longest --compare command")
    parser.add_argument("--skip-direct", action="store_true", help="skip the direct estimates at 256k and 512k")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs of the command (medians reported)")
    args = parser.parse_args(argv)
    cli = None if args.skip_cli else time_cli_runs(args.repeat)
    rows = [] if args.skip_direct else direct_rows()
    write(cli, rows, Path(args.out))
    print(f"wrote {args.out}/longest.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
