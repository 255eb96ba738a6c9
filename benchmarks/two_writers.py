"""Two writers, one directory: start two ``remat finetune`` runs on the same output_dir at the same moment, TRIES times,
and count what happens. Wanted every time: one run trains to max_steps (exit 0), the other is refused at once (exit 2,
one ``error: output_dir: ... is in use by another run (...)`` line, nothing on stdout), and the metrics file holds
exactly max_steps train rows of one attempt. Optionally (``--kill``) the trainer is then killed with SIGKILL halfway
and a third run must take the dead run's lock over with one line and resume.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/two_writers.py --tries 20 --out benchmarks/results/two_writers
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

RECIPE = """\
seed: 7
output_dir: {output_dir}
model: {{preset: tiny-llama, config: {{hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,
        num_attention_heads: 4, num_key_value_heads: 2}}}}
tokenizer: {{vocab_size: 512}}
dataset: {{seq_length: 32}}
step_scheduler: {{global_batch_size: 4, local_batch_size: 2, max_steps: {max_steps}, ckpt_every_steps: 5}}
optimizer: {{_target_: torch.optim.AdamW, lr: 0.003}}
logging: {{progress: plain}}
distributed: {{device: cpu}}
"""


_FILES: dict[int, tuple[IO[str], IO[str]]] = {}


def start(recipe: Path, name: str) -> subprocess.Popen[str]:
    """A run whose output goes to files beside the recipe (pipes nobody reads would stall a trainer)."""
    out = open(recipe.with_name(f"{name}.out"), "w+")  # noqa: SIM115 (read back in `finish`)
    err = open(recipe.with_name(f"{name}.err"), "w+")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "remat.cli", "finetune", str(recipe)], stdout=out, stderr=err,
                            text=True)
    _FILES[proc.pid] = (out, err)
    return proc


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    code = proc.wait()
    texts = []
    for handle in _FILES.pop(proc.pid):
        handle.seek(0)
        texts.append(handle.read())
        handle.close()
    return code, texts[0], texts[1]


def train_rows(output_dir: Path) -> list[dict[str, Any]]:
    path = output_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in rows if r["kind"] == "train"]


def one_try(work: Path, max_steps: int, kill: bool) -> dict[str, Any]:
    output_dir = work / "run"
    recipe = work / "recipe.yaml"
    recipe.write_text(RECIPE.format(output_dir=output_dir, max_steps=max_steps))
    runs = [start(recipe, "a"), start(recipe, "b")]
    outcome: dict[str, Any] = {}
    if kill:  # kill the trainer once it has saved step_5 and the other run has been refused
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not ((output_dir / "checkpoints" / "step_5").is_dir()
                                                   and any(p.poll() is not None for p in runs)):
            time.sleep(0.2)
        alive = [p for p in runs if p.poll() is None]
        for proc in alive:
            os.kill(proc.pid, signal.SIGKILL)
        outcome["killed"] = len(alive)
    results = [finish(p) for p in runs]
    codes = sorted(code for code, _, _ in results)
    refused = [err for code, out, err in results if code == 2]
    outcome["exit_codes"] = codes
    outcome["refusal_one_line"] = (len(refused) == 1 and len(refused[0].splitlines()) == 1
                                   and "is in use by another run (pid " in refused[0]
                                   and all(out == "" for code, out, _ in results if code == 2))
    rows = train_rows(output_dir)
    outcome["train_rows"] = len(rows)
    outcome["attempts"] = sorted({r["attempt"] for r in rows})
    if kill:
        third = subprocess.run([sys.executable, "-m", "remat.cli", "finetune", str(recipe)], capture_output=True,
                               text=True)
        takeover = [line for line in third.stdout.splitlines() if "taking over the lock" in line]
        rows = train_rows(output_dir)
        outcome["resume_exit_code"] = third.returncode
        outcome["takeover_lines"] = len(takeover)
        outcome["resumed_attempt"] = rows[-1]["attempt"] if rows else None
        outcome["last_step"] = rows[-1]["step"] if rows else None
    wanted_codes = [-9, 2] if kill else [0, 2]
    outcome["ok"] = (codes == wanted_codes and outcome["refusal_one_line"]
                     and (kill or (outcome["train_rows"] == max_steps and outcome["attempts"] == [1]))
                     and (not kill or (outcome["resume_exit_code"] == 0 and outcome["takeover_lines"] == 1
                                       and outcome["resumed_attempt"] == 2 and outcome["last_step"] == max_steps)))
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--kill", action="store_true", help="also kill -9 the trainer and resume with a third run")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json with every try")
    args = parser.parse_args()
    tries = []
    with tempfile.TemporaryDirectory(prefix="two-writers-") as tmp:
        for index in range(args.tries):
            work = Path(tmp) / f"try{index}"
            work.mkdir()
            start_time = time.monotonic()
            outcome = one_try(work, args.max_steps, args.kill)
            outcome["seconds"] = round(time.monotonic() - start_time, 1)
            tries.append(outcome)
            print(json.dumps(outcome), flush=True)
    ok = sum(t["ok"] for t in tries)
    print(f"{ok}/{len(tries)} tries as wanted" + (" (with kill -9 and resume)" if args.kill else ""))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"tries": tries, "ok": ok, "kill": args.kill,
                                                             "max_steps": args.max_steps}, indent=1) + "\n")


if __name__ == "__main__":
    main()
