"""How fast the command line answers when no training is needed: ``remat --help``, each subcommand's ``--help``, and
a recipe with a typo'd key (the target: under 1.5 s each). Each command runs in a fresh interpreter, several times,
interleaved; the table gives the median wall time, and Python's ``-X importtime`` total for ``import remat.cli``.

    .venv/bin/python benchmarks/bench_startup.py                  # writes benchmarks/results/startup.{md,json}
    .venv/bin/python benchmarks/bench_startup.py --repeats 3 --out /tmp/startup
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS: dict[str, list[str]] = {
    "remat --help": ["--help"],
    "remat finetune --help": ["finetune", "--help"],
    "remat estimate --help": ["estimate", "--help"],
    "remat finetune typo.yaml (config error)": ["finetune", "{typo}"],
}


def _time_once(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "remat.cli", *args], cwd=ROOT, capture_output=True, check=False)
    return time.perf_counter() - start


def _import_seconds() -> float:
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import remat.cli"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    line = next(line for line in reversed(done.stderr.splitlines()) if re.search(r"\|\s*remat\.cli$", line))
    return int(line.split("|")[1]) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "startup")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        typo = Path(tmp) / "typo.yaml"
        typo.write_text("model: {preset: llama-3.2-1b}\nstep_sceduler: {max_steps: 2}\n")
        commands = {name: [a.format(typo=typo) for a in argv] for name, argv in COMMANDS.items()}
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, argv in commands.items():
                times[name].append(_time_once(argv))
    rows = [{"command": name, "median_s": statistics.median(ts), "min_s": min(ts), "runs": len(ts)}
            for name, ts in times.items()]
    import_s = _import_seconds()
    lines = [f"# Start-up time of the command line ({platform.machine()}, Python {platform.python_version()}, "
             f"{args.repeats} runs each, interleaved)", "",
             f"`import remat.cli` (Python -X importtime, cumulative): {import_s:.3f} s", "",
             "| command | median s | min s |", "|---|---|---|"]
    lines += [f"| {r['command']} | {r['median_s']:.2f} | {r['min_s']:.2f} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"import_remat_cli_s": import_s, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
