"""Every shell command in README.md and docs/ is run, checked or skipped with its reason (#23: "Docs that run").

Each command line of a ``bash`` block (continuations joined, comments dropped) has an entry in `COMMANDS`:

- ``RUN``: run as written in a scratch directory that links ``examples/`` and ``benchmarks/`` (``remat`` in this
  process through `remat.cli.main`, ``python`` as a subprocess); it must exit 0.
- ``CHECK``: a command whose full run is long (a fine-tune, a plan over a 1B model) or needs what this machine has
  not (GPUs, several nodes, the Hub): ``remat finetune`` runs as written plus ``--print-config``, which validates the
  recipe, every override and the launcher flags and stops before training; ``estimate``, ``plan`` and ``profile`` are
  parsed by the CLI's own parser and their recipe overrides validated, and the files they name must exist. A reader's
  ``recipe.yaml`` is the FSDP2 quick-start recipe, ``my.yaml``/``calibration.json``/``my_long_docs.jsonl`` small
  stand-ins.
- any other value: why the command is not run here, and where what it does is tested.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = "run"
CHECK = "check"
_GPU = "needs a CUDA GPU (benchmarks/gpu_acceptance.sh; tests/test_gpu_acceptance_script.py checks the script)"
_SETUP = "sets up a fresh machine: CI's .ci/run runs it on a clean clone"

COMMANDS: dict[str, str] = {
    # README.md
    "python3.11 -m venv .venv && .venv/bin/pip install -c constraints.txt -e . && .venv/bin/remat finetune "
    "examples/quickstart.yaml": _SETUP,
    "python3.11 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e '.[test]' && .venv/bin/pytest -q "
    "-n 2 --dist loadfile": _SETUP,
    "remat finetune examples/fsdp2_quickstart.yaml --nproc-per-node 2": CHECK,
    "remat finetune examples/ddp_quickstart.yaml --nproc-per-node 2": CHECK,
    "remat estimate --preset llama-3.2-1b --batch-size 8 --seq-length 2048 --autocast bfloat16 --compare --fits 80GiB":
        CHECK,
    # docs/checkpointing.md
    "python benchmarks/bench_gpu.py": _GPU,
    "python benchmarks/bench_gpu.py --profile selective,torch-sac": _GPU,
    # docs/distributed.md
    "remat finetune examples/fsdp2_quickstart.yaml --nproc-per-node gpu": CHECK,
    "torchrun --standalone --nproc-per-node 8 -m remat.cli finetune recipe.yaml --step_scheduler.max_steps 1000":
        "8 processes under torchrun (the workers' path: tests/distributed/test_launch.py)",
    "remat finetune recipe.yaml --nproc-per-node 8 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500": CHECK,
    "remat finetune recipe.yaml --nproc-per-node 8 --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29500": CHECK,
    "remat finetune recipe.yaml --nproc-per-node 8 --nnodes 2 --rdzv-backend c10d --rdzv-endpoint node0:29500 "
    "--rdzv-id my-job-42": CHECK,
    # docs/estimate.md
    "remat estimate examples/llama_3_2_1b_seed.yaml": CHECK,
    "remat estimate examples/llama_3_2_1b_seed.yaml --compare --fits 80GiB --plot estimate.png": CHECK,
    "remat estimate --preset llama-3.2-1b --batch-size 8 --seq-length 2048 --dtype bfloat16 --policy full --loss fused":
        RUN,
    "remat estimate --config path/to/config.json --compare --setting policy=sqrt --setting batch_size=16,loss=fused":
        CHECK,
    "remat estimate meta-llama/Llama-3.1-8B --batch-size 1 --seq-length 8192 --autocast bfloat16 --compare "
    "--fits 80GiB": CHECK,
    # docs/gpu.md
    **{f"bash benchmarks/gpu_acceptance.sh {part}": _GPU
       for part in ("wheels", "cuda-tests", "suite", "policies", "loss", "backends", "selective", "estimate", "profile",
                    "long", "pareto", "trl")},
    # docs/long-context.md
    "remat estimate --preset llama-3.2-1b --batch-size 1 --dtype bfloat16 --longest --fits 80GiB --compare "
    "--json out.json": CHECK,
    "remat estimate examples/long_context.yaml --longest --fits 80GiB": CHECK,
    "remat finetune examples/long_context.yaml --dataset.seq_length 262144 --dataset.path my_long_docs.jsonl": CHECK,
    "remat finetune examples/long_context_cp.yaml --nproc-per-node 2": CHECK,
    "remat estimate --preset llama-3.2-1b --batch-size 1 --dtype bfloat16 --longest --fits 80GiB --cp-size 8": CHECK,
    "torchrun --nproc-per-node 8 benchmarks/bench_context_parallel.py": "needs 8 GPUs (gpu_acceptance.sh context)",
    "torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py --lengths 131072,262144":
        "needs 2 GPUs (gpu_acceptance.sh context)",
    "python benchmarks/bench_gpu.py --long-context": _GPU,
    "python benchmarks/bench_gpu.py --long-context --lengths 524288,655360 --budget-seconds 500": _GPU,
    # docs/loss.md
    "python benchmarks/bench_loss_cuda.py": _GPU,
    "python benchmarks/bench_loss_cuda.py --check-on-cpu": RUN,
    # docs/planner.md
    "remat plan examples/llama_3_2_1b_seed.yaml --budget 80GiB --budget 40GiB --budget 20GiB --budget 12GiB "
    "--target cuda --json plan.json --png plan.png": CHECK,
    "remat plan meta-llama/Llama-3.2-1B --batch-size 8 --seq-length 2048 --autocast bfloat16 --loss fused "
    "--target cuda --budget 20GiB --budget 12GiB": CHECK,
    "remat profile examples/quickstart.yaml --policies none,selective,full --steps 4": CHECK,
    "remat profile recipe.yaml --policies none,full,auto --budget 20GiB --budget 30GiB --json profile.json "
    "--png profile.png": CHECK,
    "remat profile recipe.yaml --policies none,attention,selective,full --steps 8 --warmup 2 "
    "--write-calibration calibration.json": CHECK,
    "remat plan recipe.yaml --budget 20GiB --calibration calibration.json": CHECK,
    # docs/recipes.md
    "remat finetune examples/quickstart.yaml": CHECK,
    "remat finetune examples/quickstart.yaml --step_scheduler.max_steps 10 "
    "--distributed.activation_checkpointing selective": CHECK,
    "remat finetune examples/quickstart.yaml --print-config": RUN,
    "remat finetune --help": RUN,
    "remat recipes": RUN,
    "remat finetune quickstart": CHECK,
    "remat recipes copy quickstart my.yaml": RUN,
    "remat finetune recipe.yaml --custom_target_packages '[my_project]'": CHECK,
    "remat finetune recipe.yaml --trust-remote-code": CHECK,
}


def shell_commands(path: Path) -> list[str]:
    """The command lines of ``path``'s bash blocks: continuations joined, comments and blank lines dropped."""
    commands = []
    for block in re.split(r"```(?:bash|sh|shell)\n", path.read_text())[1:]:
        for line in re.sub(r"\\\n\s*", " ", block.split("```", 1)[0]).splitlines():
            line = "" if line.lstrip().startswith("#") else line.split(" #", 1)[0]
            if line.strip():
                commands.append(" ".join(line.split()))
    return commands


ALL = sorted({command for path in DOCS for command in shell_commands(path)})


def test_every_shell_command_of_the_docs_is_run_checked_or_says_why_not() -> None:
    assert sorted(COMMANDS) == ALL, (
        f"not listed in COMMANDS: {sorted(set(ALL) - set(COMMANDS))}; listed but gone from the docs: "
        f"{sorted(set(COMMANDS) - set(ALL))}")
    assert len(ALL) >= 40


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A working directory where ``examples/`` and ``benchmarks/`` resolve as in the repository, and the reader's
    files exist: ``recipe.yaml`` (the FSDP2 quick start), ``my.yaml``, ``calibration.json``, a long-document file."""
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    recipe = (ROOT / "examples" / "fsdp2_quickstart.yaml").read_text()
    (tmp_path / "recipe.yaml").write_text(recipe)
    (tmp_path / "my_long_docs.jsonl").write_text(json.dumps({"text": "a b c d " * 64}) + "\n")
    (tmp_path / "path" / "to").mkdir(parents=True)
    (tmp_path / "path" / "to" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}))
    # a stand-in for the file `remat profile --write-calibration` writes
    shutil.copy(ROOT / "benchmarks" / "results" / "calibration_quickstart_cpu.json", tmp_path / "calibration.json")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "cache"))
    before = _tree_state()
    yield tmp_path
    assert _tree_state() == before, "a docs command wrote into the repository's examples/ or benchmarks/"


def _tree_state() -> dict[str, int]:
    """Each file under the linked folders, with its modification time: a command run here must not change them (the
    loss bench's CPU check once replaced the GPU's committed results)."""
    return {str(path): path.stat().st_mtime_ns for name in ("examples", "benchmarks") for path in (ROOT / name).rglob("*")
            if path.is_file() and "__pycache__" not in path.parts}


def _check(argv: list[str]) -> None:
    """The command as far as it goes without its long work (see the module docstring)."""
    from remat.cli import build_parser, main
    from remat.recipes.loader import load_recipe_data
    from remat.units import parse_capacity

    if argv[1] == "finetune":  # --print-config only warns of a missing data file; a documented command has its data
        import logging

        missing: list[str] = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: missing.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("remat.commands.finetune").addHandler(handler)
        try:
            assert main([*argv[1:], "--print-config"]) == 0
        finally:
            logging.getLogger("remat.commands.finetune").removeHandler(handler)
        assert not [line for line in missing if "does not exist" in line], missing
        return
    args, extra = build_parser().parse_known_args(argv[1:])
    source = getattr(args, "recipe", None) or getattr(args, "model", None)
    named = [value for value in argv[2:] if value.endswith((".yaml", ".json")) and not value.startswith("-")]
    outputs = {getattr(args, flag, None) for flag in ("json", "png", "plot", "write_calibration")}
    for value in named:
        assert value in outputs or Path(value).exists(), f"{value} named by {' '.join(argv)} does not exist"
    for flag in ("--fits", "--budget"):  # sizes the way the commands read them (a unit is required)
        for value in (argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag):
            parse_capacity(value, key=flag)
    if isinstance(source, str) and source.endswith(".yaml"):
        load_recipe_data(source, extra)
    else:
        assert not extra, f"{' '.join(argv)}: not understood: {extra}"


@pytest.mark.slow
@pytest.mark.parametrize("command", [c for c in sorted(COMMANDS) if COMMANDS[c] in (RUN, CHECK)])
def test_docs_shell_commands_run_or_check(command: str, scratch: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = shlex.split(command)
    if argv[0] == "python":
        done = subprocess.run([sys.executable, *argv[1:]], cwd=scratch, capture_output=True, text=True, timeout=600,
                              env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                                   "HOME": str(scratch)})
        assert done.returncode == 0, done.stderr[-2000:]
        return
    assert argv[0] == "remat", command
    if COMMANDS[command] == CHECK:
        _check(argv)
        return
    from remat.cli import main

    try:
        code = main(argv[1:])
    except SystemExit as exit_:  # --help
        code = int(exit_.code or 0)
    assert code == 0, capsys.readouterr().err[-2000:]
