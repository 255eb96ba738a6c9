"""Fault injection on checkpoint saves: kill -9 in the middle of saves (one process; one of 2 ranks under ddp and
fsdp2) and same-size corruption of every file kind of a checkpoint; counts lost checkpoints (wanted: 0).

Scenarios (``--scenarios``, each run ``--tries`` times):

- ``single``: ``remat finetune <tiny recipe>`` (a 2-layer, hidden-64 Llama on CPU, a checkpoint every step,
  ``keep_last: 2``) is SIGKILLed 0-100 ms (`--max-delay-ms`) after the temporary directory of a randomly drawn save
  (``.tmp-step_N-<pid>``) appears. ``ddp``, ``fsdp2``: the same with ``--nproc-per-node 2`` (gloo), killing one
  worker (random rank); no ``--max-restarts``, so the launcher ends the run with a non-zero status
  (restarts are measured by ``benchmarks/restart_trials.py``). After the kill: every checkpoint complete just
  before it must still be there and verify (``verify_checkpoint``), unless ``keep_last`` newer ones verify (the run's
  own pruning), and ``latest`` must name a checkpoint that verifies. Then the same command is run again: it must
  resume from the newest checkpoint that verifies (at least the newest complete before the kill), reach
  ``max_steps`` and exit 0.
- ``corrupt``: a finished run (steps 2 and 4 saved) is copied, one file of ``step_4`` is corrupted in place (same
  size, bytes flipped at a random offset) and the run is started again. Kinds: ``model.safetensors`` (data and
  header), ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pt``, ``train_state.json``, ``COMPLETE.json``, and a DCP
  shard of an fsdp2 checkpoint: the resume must fall back to ``step_2``; a garbage ``latest`` pointer: the resume
  uses ``step_4`` (docs/recipes.md, "Verified resume, and starting over"). Every file's bytes (but ``latest``,
  which the resume rewrites) must still exist afterwards: nothing deleted.
- ``corrupt_stacked`` (the short form of ``corrupt``, one resume): a run saves steps 1-8, each of steps 8..2 gets
  one single-process file kind corrupted and ``latest`` is garbage; the resume must skip 8..2, each with its reason,
  and load step 1, deleting nothing.

A *lost checkpoint* is one complete before the kill (or the corruption) that is missing or fails to verify
afterwards, or a resume from an older step than the newest one that verifies.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src python benchmarks/fault_injection.py --tries 20 \
        --out benchmarks/results/fault_injection

prints a table and writes ``<out>.md`` and ``<out>.json``; exits 1 when a checkpoint was lost or a resume failed.
``tests/distributed/test_fault_injection.py`` runs a short form in the normal test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from restart_trials import SRC, TrialSettings, _last_step, _resumed_step, _workers, tiny_recipe  # noqa: E402

KILL_SCENARIOS = ("single", "ddp", "fsdp2")
SCENARIOS = (*KILL_SCENARIOS, "corrupt", "corrupt_stacked")
CORRUPTIONS = ("safetensors_data", "safetensors_header", "optimizer.pt", "scheduler.pt", "rng_state.pt",
               "train_state.json", "COMPLETE.json", "latest", "dcp_shard")
_TEMP_STEP = re.compile(r"^\.tmp-step_(\d+)-\d+$")


@dataclass
class FaultSettings:
    """The tiny run every trial starts, and how long to wait for it."""

    max_steps: int = 8
    keep_last: int = 2
    max_delay_s: float = 0.1
    """The kill comes this long at most (uniform) after the temporary directory of the drawn save appears (a save of
    the tiny model takes 30-70 ms on 2 busy CPU cores, so most kills land inside it)."""
    timeout_s: float = 300.0


@dataclass
class FaultResult:
    """One trial. ``lost``: checkpoints lost (see the module docstring); ``ok``: no loss and every check passed."""

    scenario: str
    index: int
    ok: bool
    hit_save: bool
    lost: list[str]
    resumed_correctly: bool
    detail: str
    seconds: float
    problems: list[str] = field(default_factory=list)
    log_tail: str = ""


def _recipe(output_dir: Path, strategy: str, settings: FaultSettings, *, max_steps: int | None = None,
            ckpt_every: int = 1, keep_last: int | None = None) -> dict[str, Any]:
    base = TrialSettings(max_steps=max_steps or settings.max_steps, ckpt_every=ckpt_every, strategy=strategy)
    recipe = tiny_recipe(output_dir, base)
    recipe["checkpoint"]["keep_last"] = keep_last
    return recipe


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _command(recipe: Path, ranks: int) -> list[str]:
    extra = ["--nproc-per-node", str(ranks)] if ranks > 1 else []
    return [sys.executable, "-m", "remat.cli", "finetune", str(recipe), *extra]


def _run(recipe: Path, ranks: int, log: Path, timeout_s: float) -> tuple[int | None, str]:
    """Run to the end (killed after `timeout_s`); the exit status (None: timed out) and the output."""
    with log.open("w") as sink:
        proc = subprocess.Popen(_command(recipe, ranks), stdout=sink, stderr=subprocess.STDOUT, env=_env(),
                                cwd=recipe.parent, start_new_session=True)
        code = _wait(proc, timeout_s)
    return code, log.read_text(errors="replace")


def _wait(proc: subprocess.Popen[Any], timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in _workers(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def _step(path: Path) -> int:
    return int(path.name.rsplit("_", 1)[1])


def _verifying(root: Path) -> dict[str, int]:
    """The checkpoints under `root` that verify, by name → step."""
    from remat.training_state.layout import list_checkpoints
    from remat.training_state.verify import verify_checkpoint

    return {p.name: _step(p) for p in list_checkpoints(root) if verify_checkpoint(p) is None} if root.is_dir() else {}


def _temp_saves(root: Path) -> dict[str, int]:
    """Temporary save directories under `root` (a save in progress, or one a kill interrupted), name → step."""
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    return {name: int(m.group(1)) for name in names if (m := _TEMP_STEP.match(name))}


def lost_after_kill(root: Path, complete_at_kill: list[str], keep_last: int) -> tuple[list[str], list[str]]:
    """(lost checkpoints, other problems) right after a kill: each checkpoint complete at the kill is present and
    verifies unless `keep_last` newer ones verify; ``latest`` names one that verifies."""
    verifying = _verifying(root)
    lost = []
    for name in complete_at_kill:
        step = int(name.rsplit("_", 1)[1])
        if name not in verifying and sum(s > step for s in verifying.values()) < keep_last:
            lost.append(name)
    problems = []
    pointer = root / "latest"
    named = pointer.read_text(errors="replace").strip() if pointer.is_file() else None
    if verifying and named not in verifying:
        problems.append(f"latest names {named!r}, not a checkpoint that verifies ({sorted(verifying)})")
    return lost, problems


def kill_trial(scenario: str, index: int, workdir: Path, settings: FaultSettings,
               rng: random.Random) -> FaultResult:
    """kill -9 during a save (one process, or one of 2 ranks), check, re-run, check (see the module docstring)."""
    from remat.training_state.layout import list_checkpoints

    ranks = 1 if scenario == "single" else 2
    out = workdir / f"{scenario}_{index:02d}"
    out.mkdir(parents=True)
    recipe = out / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(out / "run", scenario, settings, keep_last=settings.keep_last)))
    root = out / "run" / "checkpoints"
    target = rng.randint(2, settings.max_steps - 1)
    delay = rng.uniform(0.0, settings.max_delay_s)
    victim = rng.randrange(ranks)
    start = time.monotonic()
    problems: list[str] = []
    hit_save = False
    complete_at_kill: list[str] = []
    with (out / "killed.log").open("w") as sink:
        proc = subprocess.Popen(_command(recipe, ranks), stdout=sink, stderr=subprocess.STDOUT, env=_env(),
                                cwd=out, start_new_session=True)
        deadline = start + settings.timeout_s
        while proc.poll() is None and time.monotonic() < deadline and not any(
                step >= target for step in _temp_saves(root).values()):
            time.sleep(0.002)
        time.sleep(delay)
        victim_pid = proc.pid if ranks == 1 else dict(enumerate(_workers(proc.pid))).get(victim)
        if proc.poll() is None and victim_pid is not None:
            complete_at_kill = [p.name for p in list_checkpoints(root)]
            before = set(_temp_saves(root))
            os.kill(victim_pid, signal.SIGKILL)
            hit_save = bool(before & set(_temp_saves(root)))
        else:
            problems.append(f"no kill: the run ended before the save of step {target}")
        killed_code = _wait(proc, settings.timeout_s)
    lost, after_problems = lost_after_kill(root, complete_at_kill, settings.keep_last)
    problems += after_problems
    verifying = _verifying(root)
    newest = max([*verifying.values(), *[int(n.rsplit("_", 1)[1]) for n in complete_at_kill if n not in lost]],
                 default=0)
    code, text = _run(recipe, ranks, out / "rerun.log", settings.timeout_s)
    resumed = _resumed_step(text)
    if newest and resumed != newest:
        problems.append(f"resumed from step {resumed}, wanted {newest} (the newest checkpoint that verifies)")
        lost.append(f"resume from {resumed} < {newest}" if resumed is None or resumed < newest else "")
        lost = [x for x in lost if x]
    resumed_ok = code == 0 and resumed == newest and _last_step(out / "run" / "metrics.jsonl") == settings.max_steps
    if code != 0:
        problems.append(f"the re-run exited {code}")
    elif not resumed_ok:
        problems.append("the re-run did not reach max_steps from the newest checkpoint")
    detail = (f"save of step {target}, +{delay * 1000:.0f} ms" + (f", rank {victim}" if ranks > 1 else "")
              + f"; complete at kill {complete_at_kill}; exit {killed_code}; resumed from {resumed}")
    return FaultResult(scenario=scenario, index=index, ok=not lost and not problems and resumed_ok,
                       hit_save=hit_save, lost=lost, resumed_correctly=resumed_ok, detail=detail,
                       seconds=round(time.monotonic() - start, 1), problems=problems,
                       log_tail="" if resumed_ok and not problems else text[-3000:])


def corrupt_file(path: Path, kind: str, rng: random.Random) -> int:
    """Flip a few bytes of `path` in place (same size) in the region `kind` names; returns the offset."""
    data = bytearray(path.read_bytes())
    lo, hi = 0, len(data)
    if kind.startswith("safetensors"):
        header_end = 8 + int.from_bytes(data[:8], "little")
        lo, hi = (8, header_end) if kind == "safetensors_header" else (header_end, len(data))
    offset = rng.randrange(lo, max(lo + 1, hi - 3))
    for i in range(offset, min(offset + 4, hi)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    return offset


def _target(run: Path, kind: str, step_number: int) -> Path:
    step = run / "checkpoints" / f"step_{step_number}"
    if kind == "latest":
        return run / "checkpoints" / "latest"
    if kind == "dcp_shard":
        return sorted((step / "dcp").glob("*.distcp"))[0]
    if kind.startswith("safetensors"):
        return step / "model" / "model.safetensors"
    return step / kind


def _contents(root: Path) -> dict[str, str]:
    """SHA-256 → one relative path, for every file under `root` but ``latest`` and the run lock (both rewritten by
    every run)."""
    return {hashlib.sha256(p.read_bytes()).hexdigest(): str(p.relative_to(root))
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "latest" and not p.name.endswith(".lock")}


def finished_run(out: Path, strategy: str, settings: FaultSettings, *, max_steps: int, ckpt_every: int) -> Path:
    """Run the tiny recipe in `out` to `max_steps`, every checkpoint kept; the run's output_dir."""
    out.mkdir(parents=True, exist_ok=True)
    recipe = out / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(out / "run", strategy, settings, max_steps=max_steps,
                                             ckpt_every=ckpt_every)))
    code, text = _run(recipe, 2 if strategy != "single" else 1, out / "log.txt", settings.timeout_s)
    if code != 0 or sorted(_verifying(out / "run" / "checkpoints").values()) != list(
            range(ckpt_every, max_steps + 1, ckpt_every)):
        raise RuntimeError(f"the finished {strategy} run failed (exit {code}):\n{text[-3000:]}")
    return out / "run"


def base_runs(workdir: Path, settings: FaultSettings, kinds: list[str]) -> dict[str, Path]:
    """Finished runs (max_steps 4, a checkpoint every 2 steps) to copy: single-process, and fsdp2 when a DCP shard
    is among `kinds`."""
    return {strategy: finished_run(workdir / f"base_{strategy}", strategy, settings, max_steps=4, ckpt_every=2)
            for strategy in ["single", *(["fsdp2"] if "dcp_shard" in kinds else [])]}


def _resume_after_corruption(run: Path, recipe: Path, ranks: int, settings: FaultSettings,
                             wanted: int) -> tuple[bool, list[str], list[str], str]:
    """Start the run again; (resumed correctly, lost, problems, output): it must resume from step `wanted`, exit 0,
    end with a checkpoint that verifies at max_steps, and keep the bytes of every file but ``latest``."""
    root = run / "checkpoints"
    before = _contents(root)
    code, text = _run(recipe, ranks, recipe.parent / "rerun.log", settings.timeout_s)
    resumed = _resumed_step(text)
    after = _contents(root)
    lost = [f"deleted: {path}" for digest, path in sorted(before.items()) if digest not in after]
    problems = []
    if resumed != wanted:
        problems.append(f"resumed from step {resumed}, wanted {wanted}")
        if resumed is None or resumed < wanted:
            lost.append(f"resume from {resumed} < {wanted}")
    if code != 0:
        problems.append(f"the re-run exited {code}")
    final = max(yaml.safe_load(recipe.read_text())["step_scheduler"]["max_steps"], wanted)
    resumed_ok = code == 0 and resumed == wanted and final in _verifying(root).values()
    return resumed_ok, lost, problems, text


def corrupt_trial(kind: str, index: int, workdir: Path, bases: dict[str, Path], settings: FaultSettings,
                  rng: random.Random) -> FaultResult:
    """Copy a finished run, corrupt one file of its newest checkpoint, resume, check (see the module docstring)."""
    strategy, ranks = ("fsdp2", 2) if kind == "dcp_shard" else ("single", 1)
    out = workdir / f"corrupt_{kind}_{index:02d}"
    out.mkdir(parents=True)
    run = out / "run"
    shutil.copytree(bases[strategy], run, ignore=shutil.ignore_patterns("*.lock", "metrics.jsonl"))
    recipe = out / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(run, strategy, settings, max_steps=4, ckpt_every=2)))
    start = time.monotonic()
    target = _target(run, kind, 4)
    offset = corrupt_file(target, kind, rng)
    wanted = 4 if kind == "latest" else 2
    resumed_ok, lost, problems, text = _resume_after_corruption(run, recipe, ranks, settings, wanted)
    return FaultResult(scenario="corrupt", index=index, ok=resumed_ok and not lost and not problems, hit_save=False,
                       lost=lost, resumed_correctly=resumed_ok,
                       detail=f"{kind}: {target.relative_to(run)} at byte {offset}; resumed from {_resumed_step(text)}",
                       seconds=round(time.monotonic() - start, 1), problems=problems,
                       log_tail="" if resumed_ok and not problems else text[-3000:])


def stacked_corrupt_trial(index: int, workdir: Path, settings: FaultSettings, rng: random.Random) -> FaultResult:
    """Every single-process file kind at once, one per checkpoint: a run saves steps 1-8, step 8 gets a corrupt
    ``model.safetensors`` data, step 7 its header, ..., step 2 a corrupt ``COMPLETE.json``, and ``latest`` is
    garbage; the resume must say why it skips each of steps 8..2 and load step 1 (a short form of ``corrupt``)."""
    kinds = [k for k in CORRUPTIONS if k not in ("latest", "dcp_shard")]
    start = time.monotonic()
    out = workdir / f"corrupt_stacked_{index:02d}"
    run = finished_run(out, "single", settings, max_steps=len(kinds) + 1, ckpt_every=1)
    steps = list(range(len(kinds) + 1, 1, -1))
    for step, kind in zip(steps, [*kinds]):
        corrupt_file(_target(run, kind, step), kind, rng)
    corrupt_file(_target(run, "latest", 0), "latest", rng)
    resumed_ok, lost, problems, text = _resume_after_corruption(run, out / "recipe.yaml", 1, settings, 1)
    skipped = sorted({int(step) for step in re.findall(r"skipping checkpoint \S*step_(\d+)", text)}, reverse=True)
    if skipped != steps:
        problems.append(f"skipped steps {skipped}, wanted {steps}")
    return FaultResult(scenario="corrupt_stacked", index=index, ok=resumed_ok and not lost and not problems,
                       hit_save=False, lost=lost, resumed_correctly=resumed_ok,
                       detail=f"steps {steps[0]}..{steps[-1]}: {', '.join(kinds)}; latest garbage; "
                              f"resumed from {_resumed_step(text)}",
                       seconds=round(time.monotonic() - start, 1), problems=problems,
                       log_tail="" if resumed_ok and not problems else text[-3000:])


def run_scenarios(scenarios: list[str], tries: int, workdir: Path, settings: FaultSettings, seed: int,
                  kinds: list[str] | None = None, echo: bool = True,
                  on_result: Callable[[list[FaultResult]], None] | None = None) -> list[FaultResult]:
    """Every trial of `scenarios`: `tries` kills each, and `tries` rounds over the corruption `kinds`;
    `on_result` is called with the results so far after each trial (a report that survives an interrupted run)."""
    rng = random.Random(seed)
    os.environ.setdefault("REMAT_CACHE_DIR", str(workdir / "cache"))
    results: list[FaultResult] = []

    def note(result: FaultResult) -> None:
        results.append(result)
        if on_result is not None:
            on_result(results)
        if echo:
            status = "ok" if result.ok else "FAILED: " + "; ".join(result.problems + result.lost)
            print(f"{result.scenario} {result.index}: {result.detail}; hit a save: {result.hit_save}; "
                  f"{result.seconds} s: {status}", flush=True)
            if not result.ok:
                print(result.log_tail, flush=True)

    for scenario in scenarios:
        if scenario == "corrupt":
            kinds = list(kinds or CORRUPTIONS)
            bases = base_runs(workdir, settings, kinds)
            for index in range(tries):
                for kind in kinds:
                    note(corrupt_trial(kind, index, workdir, bases, settings, rng))
        elif scenario == "corrupt_stacked":
            for index in range(tries):
                note(stacked_corrupt_trial(index, workdir, settings, rng))
        else:
            for index in range(tries):
                note(kill_trial(scenario, index, workdir, settings, rng))
    return results


def summarize(results: list[FaultResult]) -> list[dict[str, Any]]:
    """One row per scenario: trials, kills that hit a save, lost checkpoints, resumed correctly."""
    rows = []
    for scenario in dict.fromkeys(r.scenario for r in results):
        chosen = [r for r in results if r.scenario == scenario]
        rows.append({"scenario": scenario, "trials": len(chosen),
                     "hit_save": sum(r.hit_save for r in chosen) if scenario in KILL_SCENARIOS else None,
                     "lost": sum(len(r.lost) for r in chosen), "resumed_correctly": sum(r.resumed_correctly
                                                                                        for r in chosen),
                     "ok": sum(r.ok for r in chosen)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| scenario | trials | kills that hit a save | lost checkpoints | resumed correctly | all checks ok |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        hit = "n/a" if row["hit_save"] is None else row["hit_save"]
        lines.append(f"| {row['scenario']} | {row['trials']} | {hit} | {row['lost']} | {row['resumed_correctly']} | "
                     f"{row['ok']} |")
    return "\n".join(lines)


def write_report(out: Path, results: list[FaultResult], settings: FaultSettings, commands: list[str]) -> None:
    """``<out>.md`` (the table, every trial, date, torch version, machine, the commands) and ``<out>.json``."""
    import torch

    head = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
            "commands": commands, "settings": asdict(settings)}
    rows = summarize(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({**head, "summary": rows, "trials": [asdict(r) for r in results]},
                                                   indent=1) + "\n")
    lines = ["# Fault injection: kill -9 during saves, corrupted checkpoint files", "",
             f"{head['date']}; torch {head['torch']}, Python {head['python']}; {head['machine']}.", "",
             *(f"    {command}" for command in commands), "",
             "*Hit a save*: the kill landed while the save's temporary directory existed (the write phase); kills in "
             "the phase after it (publishing `step_N`, moving `latest`, pruning) are not counted as hits. *Lost*: a "
             "checkpoint complete before the fault that is missing or fails to verify after it (unless `keep_last` "
             "newer ones verify), a deleted file, or a resume from an older step than the newest checkpoint that "
             "verifies. Details and the scenarios: the docstring of `benchmarks/fault_injection.py`.", "",
             table(rows), "",
             "| scenario | try | ok | hit a save | detail | problems |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.scenario} | {r.index} | {'yes' if r.ok else 'NO'} | {r.hit_save} | {r.detail} | "
                     f"{'; '.join(r.problems + r.lost)} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def merge_reports(out: Path, parts: list[Path]) -> list[FaultResult]:
    """One report at `out` from the ``.json`` reports of runs made apart (scenarios run side by side)."""
    loaded = [json.loads(part.read_text()) for part in parts]
    results = [FaultResult(**trial) for report in loaded for trial in report["trials"]]
    commands = [c for report in loaded for c in report.get("commands", [report.get("command", "")])]
    write_report(out, results, FaultSettings(**loaded[0]["settings"]), commands)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=20, help="kills per kill scenario; rounds over the corruptions")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {SCENARIOS}")
    parser.add_argument("--corruptions", default=",".join(CORRUPTIONS), help=f"comma-separated, of {CORRUPTIONS}")
    parser.add_argument("--max-steps", type=int, default=FaultSettings.max_steps)
    parser.add_argument("--max-delay-ms", type=float, default=FaultSettings.max_delay_s * 1000,
                        help="the kill comes 0 to this many ms after the drawn save's temporary directory appears")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="where the trials run (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="write <out>.md and <out>.json")
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="run nothing: merge these .json reports into --out")
    args = parser.parse_args(argv)
    if args.merge:
        if args.out is None:
            parser.error("--merge needs --out")
        results = merge_reports(args.out, args.merge)
        print(table(summarize(results)))
        return 0 if all(r.ok for r in results) else 1
    scenarios = [s for s in args.scenarios.split(",") if s]
    kinds = [k for k in args.corruptions.split(",") if k]
    for name, allowed in [*((s, SCENARIOS) for s in scenarios), *((k, CORRUPTIONS) for k in kinds)]:
        if name not in allowed:
            parser.error(f"{name!r} is not one of {', '.join(allowed)}")
    if args.max_steps < 3:
        parser.error("--max-steps must be at least 3 (a kill during a save of step 2 or later, before the last)")
    settings = FaultSettings(max_steps=args.max_steps, max_delay_s=args.max_delay_ms / 1000)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="remat-faults-"))
    out = args.out
    results = run_scenarios(scenarios, args.tries, workdir, settings, args.seed, kinds, on_result=None if out is None
                            else lambda so_far: write_report(out, so_far, settings, [
                                "OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src python benchmarks/fault_injection.py "
                                + " ".join(argv)]))
    print(table(summarize(results)))
    print(f"workdir {workdir}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
