"""Kill one of 2 worker ranks mid-run and check that ``--max-restarts 1`` restarts and resumes, N times over.

Each try launches ``python -m remat.cli finetune <tiny recipe> --nproc-per-node 2 --max-restarts 1`` (a 2-layer,
hidden-64 Llama on 2 CPU ranks, gloo, a checkpoint every ``--ckpt-every`` steps, every checkpoint kept), waits until
step ``k`` (random) is in the metrics file, sleeps a random moment, stops both workers (SIGSTOP), lists the complete
checkpoints, sends SIGKILL to one worker (random rank), lets the other go on (SIGCONT), and waits for the launcher.
A try passes when the launcher exits 0, rank 0 printed ``resumed from ... step_S``, the metrics reach
``max_steps``, the last checkpoint is ``step_<max_steps>``, every checkpoint that was complete at the kill is still
complete at the end, and the resume is from the newest of them or a newer one (rank 0, the one that writes, may
still publish a save it was making when its peer was killed). ``--launcher torchrun`` starts ``python -m
torch.distributed.run --standalone ... -m remat.cli finetune`` instead (plain torchrun, no remat launcher).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/restart_trials.py --tries 20 \
        --out benchmarks/results/restart_trials

writes ``<out>.json`` (every try) and ``<out>.md`` (a table, with date, torch version and machine). Exits 1 when a
try failed. ``tests/distributed/test_restarts.py`` runs one try of the same code in the normal test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


@dataclass
class TrialSettings:
    """What one try runs: the recipe's size and schedule, when to kill, and how long to wait."""

    max_steps: int = 16
    ckpt_every: int = 1
    kill_after: tuple[int, int] = (2, 10)
    """The kill comes after a step drawn from this range (inclusive) has been logged..."""
    max_delay_s: float = 1.0
    """...plus a random delay of up to this many seconds (so it lands in steps, saves and collectives alike)."""
    timeout_s: float = 300.0
    strategy: str = "ddp"
    launcher: str = "remat"
    extra_args: list[str] = field(default_factory=list)


@dataclass
class TrialResult:
    """What happened in one try (``ok`` when every check passed; ``problems`` says what failed otherwise)."""

    index: int
    ok: bool
    exit_code: int | None
    seconds: float
    kill_after_step: int
    delay_s: float
    victim_rank: int | None
    step_at_kill: int | None
    resumed_from_step: int | None
    final_step: int | None
    restart_s: float | None
    checkpoints_at_kill: list[str]
    problems: list[str]
    log_tail: str = ""


def tiny_recipe(output_dir: Path, settings: TrialSettings) -> dict[str, Any]:
    """A recipe whose steps take a fraction of a second on 2 CPU ranks, saving every ``ckpt_every`` steps."""
    return {
        "seed": 7,
        "output_dir": str(output_dir),
        "model": {"preset": "tiny-llama",
                  "config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 4, "num_key_value_heads": 2}},
        "tokenizer": {"vocab_size": 512},
        "dataset": {"seq_length": 64, "max_samples": 20},
        "step_scheduler": {"global_batch_size": 8, "local_batch_size": 2, "max_steps": settings.max_steps,
                           "ckpt_every_steps": settings.ckpt_every},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-3},
        "loss_fn": {"_target_": "remat.loss.MaskedCrossEntropy"},
        "distributed": {"strategy": settings.strategy, "device": "cpu"},
        "checkpoint": {"resume": "auto", "keep_last": None},
        "logging": {"progress": "plain", "memory": "rss"},
    }


def launch_command(recipe: Path, settings: TrialSettings) -> list[str]:
    """The command of one try: through remat's launcher, or plain torchrun running the remat CLI."""
    if settings.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "--max-restarts", "1", "-m", "remat.cli", "finetune", str(recipe), *settings.extra_args]
    return [sys.executable, "-m", "remat.cli", "finetune", str(recipe), "--nproc-per-node", "2",
            "--max-restarts", "1", *settings.extra_args]


def run_trial(index: int, workdir: Path, settings: TrialSettings, rng: random.Random) -> TrialResult:
    """One try: launch, kill a worker after a random step and moment, wait, check (see the module docstring)."""
    from remat.training_state.layout import list_checkpoints

    out = workdir / f"try_{index:02d}"
    out.mkdir(parents=True, exist_ok=True)
    recipe = out / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(out / "run", settings)))
    metrics = out / "run" / "metrics.jsonl"
    ckpt_root = out / "run" / "checkpoints"
    kill_after = rng.randint(*settings.kill_after)
    delay = rng.uniform(0.0, settings.max_delay_s)
    victim_rank = rng.randrange(2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
    log = out / "log.txt"
    start = time.monotonic()
    problems: list[str] = []
    step_at_kill = killed_at = None
    killed_rank: int | None = None
    at_kill: list[str] = []
    restart_s: float | None = None
    with log.open("w") as sink:
        proc = subprocess.Popen(launch_command(recipe, settings), stdout=sink, stderr=subprocess.STDOUT, env=env,
                                cwd=out, start_new_session=True)
        try:
            deadline = start + settings.timeout_s
            while proc.poll() is None and _last_step(metrics) < kill_after and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(delay)
            workers = _workers(proc.pid)
            if proc.poll() is None and len(workers) == 2:
                # Both workers hold still while the checkpoints are listed, so the listing is what the kill finds
                # (a save published between a listing and the kill made the resume look newer than "at the kill").
                _signal(workers, signal.SIGSTOP)
                try:
                    at_kill = [p.name for p in list_checkpoints(ckpt_root)]
                    step_at_kill = _last_step(metrics)
                    killed_rank = victim_rank
                    os.kill(workers[victim_rank], signal.SIGKILL)
                    killed_at = time.monotonic()
                finally:
                    _signal(workers, signal.SIGCONT)
            else:
                problems.append(f"no kill: the launcher {'ended' if proc.poll() is not None else 'had'} "
                                f"{len(workers)} workers at step {_last_step(metrics)}")
            rows_at_kill = _train_rows(metrics)
            while proc.poll() is None and time.monotonic() < deadline:
                if restart_s is None and killed_at is not None and _train_rows(metrics) > rows_at_kill:
                    restart_s = round(time.monotonic() - killed_at, 1)
                time.sleep(0.05)
            if proc.poll() is None:
                problems.append(f"hung: still running after {settings.timeout_s:.0f} s")
        finally:
            if proc.poll() is None:  # torchrun starts its workers in sessions of their own: end them first
                for pid in _workers(proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    resumed = _resumed_step(text)
    final = _last_step(metrics)
    if proc.returncode != 0:
        problems.append(f"exit code {proc.returncode}")
    if killed_rank is not None and resumed is None:
        problems.append("no 'resumed from' line after the kill")
    newest_at_kill = max((int(name.rsplit("_", 1)[1]) for name in at_kill), default=0)
    if resumed is not None and resumed < newest_at_kill:
        problems.append(f"resumed from step {resumed}, older than step_{newest_at_kill} (complete at the kill)")
    if final != settings.max_steps:
        problems.append(f"metrics end at step {final}, not {settings.max_steps}")
    remaining = {p.name for p in list_checkpoints(ckpt_root)}
    lost = [name for name in at_kill if name not in remaining]
    if lost:
        problems.append(f"checkpoints complete at the kill but not at the end: {lost}")
    last = f"step_{settings.max_steps}"
    if last not in remaining:
        problems.append(f"{last} is missing")
    return TrialResult(index=index, ok=not problems, exit_code=proc.returncode, seconds=round(seconds, 1),
                       kill_after_step=kill_after, delay_s=round(delay, 3), victim_rank=killed_rank,
                       step_at_kill=step_at_kill, resumed_from_step=resumed, final_step=final,
                       restart_s=restart_s, checkpoints_at_kill=at_kill, problems=problems,
                       log_tail="" if not problems else text[-3000:])


def _last_step(metrics: Path) -> int:
    """The highest training step in the metrics file (0 when none yet)."""
    if not metrics.is_file():
        return 0
    steps = [0]
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if row.get("kind") == "train":
            steps.append(int(row["step"]))
    return max(steps)


def _workers(launcher_pid: int) -> list[int]:
    """The worker processes of the launcher (its children running ``remat.cli``), by local rank."""
    children: list[int] = []
    for task in Path(f"/proc/{launcher_pid}/task").glob("*"):
        try:
            children += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    ranks: dict[int, int] = {}
    for pid in children:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        variables = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if b"LOCAL_RANK" in variables:
            ranks[int(variables[b"LOCAL_RANK"])] = pid
    return [ranks[rank] for rank in sorted(ranks)]


def _signal(pids: list[int], signum: int) -> None:
    """Send `signum` to each of `pids` that still exists."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _resumed_step(text: str) -> int | None:
    """The step of the last ``resumed from .../step_S at step S`` line."""
    found = None
    for line in text.splitlines():
        if "resumed from " in line and " at step " in line:
            found = int(line.rsplit(" at step ", 1)[1].split()[0])
    return found


def _train_rows(metrics: Path) -> int:
    """How many training rows the metrics file holds (resumed runs append, so this only grows)."""
    if not metrics.is_file():
        return 0
    return sum('"kind": "train"' in line for line in metrics.read_text().splitlines())


def summary(results: list[TrialResult], settings: TrialSettings) -> dict[str, Any]:
    """The report's header: counts, the machine and versions, the settings."""
    import torch

    restarts = sorted(r.restart_s for r in results if r.restart_s is not None)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "tries": len(results), "passed": sum(r.ok for r in results),
        "median_restart_s": restarts[len(restarts) // 2] if restarts else None,
        "settings": asdict(settings),
    }


def write_report(out: Path, results: list[TrialResult], settings: TrialSettings) -> None:
    """``<out>.json`` and ``<out>.md``."""
    head = summary(results, settings)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**head, "trials": [asdict(r) for r in results]}, indent=1))
    lines = [
        f"# Restart trials: kill -9 of one of 2 ranks, `--max-restarts 1` ({head['passed']} of {head['tries']} "
        "passed)", "",
        f"{head['date']}; torch {head['torch']}, Python {head['python']}; {head['machine']}.", "",
        f"Launcher: {settings.launcher}; strategy {settings.strategy}; max_steps {settings.max_steps}, a checkpoint "
        f"every {settings.ckpt_every} step(s); kill after a step in {list(settings.kill_after)} + 0-"
        f"{settings.max_delay_s} s. Median seconds from the kill to the first resumed step: "
        f"{head['median_restart_s']}.", "",
        "| try | ok | exit | victim rank | step at kill | resumed from | final step | kill→next step logged (s) | "
        "total (s) | problems |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r.index} | {'yes' if r.ok else 'NO'} | {r.exit_code} | {r.victim_rank} | {r.step_at_kill} "
                     f"| {r.resumed_from_step} | {r.final_step} | {r.restart_s} | {r.seconds} | "
                     f"{'; '.join(r.problems)} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=20)
    parser.add_argument("--max-steps", type=int, default=TrialSettings.max_steps)
    parser.add_argument("--ckpt-every", type=int, default=TrialSettings.ckpt_every)
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), default=TrialSettings.strategy)
    parser.add_argument("--launcher", choices=("remat", "torchrun"), default=TrialSettings.launcher)
    parser.add_argument("--timeout-s", type=float, default=TrialSettings.timeout_s)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="where the tries run (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="write <out>.json and <out>.md")
    args = parser.parse_args(argv)
    import tempfile

    settings = TrialSettings(max_steps=args.max_steps, ckpt_every=args.ckpt_every, strategy=args.strategy,
                             launcher=args.launcher, timeout_s=args.timeout_s,
                             kill_after=(2, max(2, args.max_steps - 6)))
    rng = random.Random(args.seed)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="remat-restarts-"))
    os.environ.setdefault("REMAT_CACHE_DIR", str(workdir / "cache"))
    results = []
    for index in range(args.tries):
        result = run_trial(index, workdir, settings, rng)
        results.append(result)
        status = "ok" if result.ok else "FAILED: " + "; ".join(result.problems)
        print(f"try {index}: rank {result.victim_rank} killed at step {result.step_at_kill}, resumed from "
              f"{result.resumed_from_step}, final {result.final_step}, {result.seconds} s: {status}", flush=True)
        if not result.ok:
            print(result.log_tail, flush=True)
    if args.out is not None:
        write_report(args.out, results, settings)
    passed = sum(r.ok for r in results)
    print(f"{passed} of {len(results)} tries passed (workdir {workdir})")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
