"""Peak host memory of building a dataset from one long JSONL line vs the same text in short lines.

For each size (MB of text), the same English text (the builtin corpus, repeated) is written as one JSONL row
(`{"text": ...}` on a single line) and as rows of about 2 kB cut at spaces, and each file is tokenized with the
builtin tokenizer and packed into rows of 256 tokens by `remat.data.build_dataset`, each build in a fresh process
that reports its peak RSS (`VmHWM`). The baseline is the same process after its imports and the tokenizer load.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_long_documents.py --sizes 20 200
    PYTHONPATH=src .venv/bin/python benchmarks/bench_long_documents.py --sizes 20 200 --out benchmarks/results
    PYTHONPATH=/other/checkout/src .venv/bin/python benchmarks/bench_long_documents.py --sizes 20 --label before

Results go to OUT/long_documents.{json,md} only when --out is given (tracked results are never rewritten by default).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHORT_ROW_CHARS = 2000

# The child reads its peak RSS from /proc/self/status (VmHWM, this process's own address space): ru_maxrss would
# start at the parent's RSS, which a child inherits across exec on Linux.
_CHILD = r"""
import json, sys, time
from remat.data import DatasetConfig, TokenizerConfig, build_dataset, build_tokenizer
def hwm_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
tokenizer = build_tokenizer(TokenizerConfig())
base = hwm_kib()
start = time.perf_counter()
dataset = build_dataset(DatasetConfig(path=sys.argv[1], seq_length=256, shuffle=False), tokenizer)
seconds = time.perf_counter() - start
peak = hwm_kib()
print(json.dumps({"baseline_kib": base, "peak_kib": peak, "seconds": seconds, "rows": len(dataset),
                  "tokens": int(dataset.tensors["input_ids"].numel())}))
"""


def english_text(megabytes: float) -> str:
    """`megabytes` MB of English text: the builtin corpus's documents joined by blank lines, repeated."""
    from remat.data.corpus import builtin_documents

    corpus = "\n\n".join(builtin_documents("train"))
    size = int(megabytes * 1e6)
    return (corpus * (size // len(corpus) + 1))[:size]


def short_rows(text: str, chars: int = SHORT_ROW_CHARS) -> list[str]:
    """`text` cut into rows of about `chars` characters, each cut just before a space."""
    rows, start = [], 0
    while start < len(text):
        end = text.find(" ", start + chars)
        end = len(text) if end < 0 else end
        rows.append(text[start:end])
        start = end
    return rows


def write_jsonl(path: Path, texts: list[str]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}) + "\n")


def measure(path: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}",
                "returncode": done.returncode}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[20.0], help="MB of text per file")
    parser.add_argument("--label", default="streaming", help="a name for the code measured (e.g. before)")
    parser.add_argument("--out", type=Path, help="directory for long_documents.{json,md} (default: print only)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for megabytes in args.sizes:
            text = english_text(megabytes)
            for layout, texts in (("single line", [text]), ("short lines", short_rows(text))):
                path = Path(tmp) / f"{megabytes:g}mb-{layout.replace(' ', '-')}.jsonl"
                write_jsonl(path, texts)
                del texts
                started = time.perf_counter()
                row = {"label": args.label, "mb": megabytes, "layout": layout, **measure(path),
                       "wall_seconds": round(time.perf_counter() - started, 1)}
                path.unlink()
                print(json.dumps(row), flush=True)
                results.append(row)
            del text
    if args.out is None:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    (args.out / "long_documents.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    lines = ["| code | MB of text | layout | tokens | peak RSS (MiB) | after imports (MiB) | build (MiB) | s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | {r['mb']:g} | {r['layout']} | - | failed: {r['error']} | | | |")
            continue
        lines.append(f"| {r['label']} | {r['mb']:g} | {r['layout']} | {r['tokens']:,} | {r['peak_kib'] / 1024:.0f} | "
                     f"{r['baseline_kib'] / 1024:.0f} | {(r['peak_kib'] - r['baseline_kib']) / 1024:.0f} | "
                     f"{r['seconds']:.1f} |")
    (args.out / "long_documents.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
