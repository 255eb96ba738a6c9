"""How fast checkpoint files are hashed for ``COMPLETE.json`` (`remat.training_state.digest`), and what the
hashing adds to a real save.

1. Throughput of the streamed hash of one file (sha256 and blake2b for comparison, 1/4/8 MiB read buffers), and of
   `digests` over several files (threads), on random bytes written to a temporary directory (page-cached, as they
   are right after a save).
2. A tiny-Llama `save_checkpoint`: median wall time of the save, and the part of it spent in `write_marker`.

Results go to benchmarks/results/checkpoint_hash.{json,md}.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_checkpoint_hash.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_checkpoint_hash.py --megabytes 64 --out /tmp/hash
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from remat.training_state import digest


def _stream_hash(path: Path, algorithm: str, buffer_bytes: int) -> float:
    start = time.perf_counter()
    hasher = hashlib.new(algorithm)
    view = memoryview(bytearray(buffer_bytes))
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(view):
            hasher.update(view[:read])
    return time.perf_counter() - start


def throughput(work: Path, megabytes: int, repeats: int) -> dict[str, Any]:
    one = work / "one.bin"
    one.write_bytes(os.urandom(megabytes << 20))
    rows: dict[str, Any] = {}
    for algorithm in ("sha256", "blake2b"):
        for buffer_mib in (1, 4, 8):
            best = min(_stream_hash(one, algorithm, buffer_mib << 20) for _ in range(repeats))
            rows[f"{algorithm} {buffer_mib} MiB buffer"] = round(megabytes / best)
    parts = []
    for index in range(4):
        part = work / f"part{index}.bin"
        part.write_bytes(os.urandom((megabytes // 4) << 20))
        parts.append(part)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        digest.digests(parts)
        times.append(time.perf_counter() - start)
    rows["digests() over 4 files (threads)"] = round(megabytes / min(times))
    return rows


def tiny_save(work: Path, repeats: int) -> dict[str, Any]:
    import torch

    from remat.models import ModelConfig, build_model
    from remat.training_state import layout, single

    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny-llama"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long), labels=torch.zeros(1, 8, dtype=torch.long)).loss.backward()
    optimizer.step()
    marker_times: list[float] = []
    real_write_marker = layout.write_marker

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        real_write_marker(*args, **kwargs)
        marker_times.append(time.perf_counter() - start)

    single.write_marker = timed  # type: ignore[assignment]
    saves = []
    try:
        for step in range(repeats):
            start = time.perf_counter()
            path = single.save_checkpoint(work / "ckpt", step + 1, model=model, optimizer=optimizer,
                                          train_state={"step": step + 1}, keep_last=1)
            saves.append(time.perf_counter() - start)
    finally:
        single.write_marker = real_write_marker  # type: ignore[assignment]
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return {"checkpoint_mb": round(size / 2**20, 1), "save_median_s": round(statistics.median(saves), 3),
            "write_marker_median_s": round(statistics.median(marker_times), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                  "load_average_1min_before": round(os.getloadavg()[0], 2),
                  "megabytes": args.megabytes, "mib_per_s": throughput(work, args.megabytes, args.repeats),
                  "tiny_llama_save": tiny_save(work, args.repeats)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checkpoint_hash.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# Checkpoint hashing (`benchmarks/bench_checkpoint_hash.py`)", "",
             f"{result['machine']} (1-minute load average {result['load_average_1min_before']} before the run: "
             "other processes share these cores); "
             f"{args.megabytes} MiB of random bytes, page-cached; best of {args.repeats}.", "",
             "| hash | MiB/s |", "|---|---:|"]
    lines += [f"| {name} | {speed} |" for name, speed in result["mib_per_s"].items()]
    save = result["tiny_llama_save"]
    lines += ["", f"tiny-llama save ({save['checkpoint_mb']} MiB with AdamW state): median {save['save_median_s']} s, "
                  f"of which write_marker (hashing) {save['write_marker_median_s']} s."]
    (args.out / "checkpoint_hash.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
