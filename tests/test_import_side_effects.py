"""`import remat` leaves the process alone (no torch, no environment change); the command line sets
OMP_WAIT_POLICY before torch loads, keeping a value the user set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
PROBE = ("import os, sys; import {module}; "
         "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules, hasattr({module}, '__name__'))")


def _probe(module: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    clean["PYTHONPATH"] = SRC + os.pathsep + clean.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], env={**clean, **env},
                         capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.strip()


def test_import_remat_loads_nothing_and_sets_nothing() -> None:
    assert _probe("remat") == "None False True"


@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_command_line_sets_a_passive_wait_before_torch_loads(given: str | None, expected: str) -> None:
    env = {"OMP_WAIT_POLICY": given} if given else {}
    assert _probe("remat.cli", **env) == f"{expected} False True"


def test_public_names_resolve_lazily() -> None:
    import remat

    assert remat.estimate_memory.__module__ == "remat.estimate.api"
    assert remat.CheckpointPolicy.__name__ == "CheckpointPolicy"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = remat.nope


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``remat ARGS`` in a fresh interpreter that reports at exit whether torch or transformers were imported."""
    probe = ("import atexit, sys; atexit.register(lambda: print('heavy:', sorted(m for m in ('torch', 'transformers') "
             "if m in sys.modules), file=sys.stderr)); from remat.cli import main; raise SystemExit(main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", probe, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args", [("--help",), ("finetune", "--help"), ("estimate", "--help"), ("report", "--help"),
                                  ("plan", "--help"), ("profile", "--help"),
                                  ("recipes", "--help")])
def test_help_loads_neither_torch_nor_transformers(args: tuple[str, ...], tmp_path: Path) -> None:
    done = _run_cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "usage: remat" in done.stdout
    assert "heavy: []" in done.stderr


def test_a_recipe_mistake_is_reported_before_torch_loads(tmp_path: Path) -> None:
    recipe = tmp_path / "typo.yaml"
    recipe.write_text("model: {preset: tiny-llama}\nstep_sceduler: {max_steps: 2}\n")
    done = _run_cli("finetune", str(recipe), cwd=tmp_path)
    assert done.returncode == 2
    assert "step_sceduler: unknown key (did you mean 'step_scheduler'?); allowed keys here" in done.stderr
    assert "heavy: []" in done.stderr


def test_an_unknown_profile_policy_is_reported_before_torch_loads(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {preset: tiny-llama}\n")
    done = _run_cli("profile", str(recipe), "--policies", "none,selectve", cwd=tmp_path)
    assert done.returncode == 2
    assert "error: --policies: got 'selectve'; allowed: true, false, full, none, selective" in done.stderr
    assert "(did you mean 'selective'?); or auto" in done.stderr and "heavy: []" in done.stderr


def test_listing_the_shipped_recipes_loads_neither_torch_nor_transformers(tmp_path: Path) -> None:
    done = _run_cli("recipes", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "quickstart" in done.stdout and "heavy: []" in done.stderr


def _recipe(tmp_path: Path, text: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text("model: {preset: tiny-llama}\nstep_scheduler: {global_batch_size: 2, local_batch_size: 2, "
                    "max_steps: 1}\n" + text)
    return str(path)


@pytest.mark.parametrize(("args", "message"), [
    (("finetune", "{recipe}"), "dataset.path: '/no/such/data.jsonl' does not exist"),
    (("finetune", "{plain}", "--nproc-per-node", "2"), "distributed.strategy: 'single' runs one process, but the "
                                                         "launch has 2"),
    (("finetune", "{auto}"), "distributed.activation_checkpointing.memory_budget: required here: planning for the CPU"),
    (("report", "{missing}"), "is not a directory; give a run's output_dir"),
    (("estimate", "--preset", "tiny-llama", "--fits", "80"), "error: --fits: got '80'; allowed: a number with a unit"),
])
def test_mistakes_that_need_no_model_are_said_before_torch_loads(args: tuple[str, ...], message: str,
                                                                  tmp_path: Path) -> None:
    """Issue #23 item 3: each answers in one line without importing torch or transformers (well under 2 s)."""
    recipe = _recipe(tmp_path, "dataset: {path: /no/such/data.jsonl, seq_length: 32}\n")
    (tmp_path / "auto").mkdir()
    auto = _recipe(tmp_path / "auto", "distributed: {activation_checkpointing: auto, device: cpu}\n")
    (tmp_path / "plain").mkdir()
    plain = _recipe(tmp_path / "plain", "")
    filled = [a.format(recipe=recipe, auto=auto, plain=plain, missing=tmp_path / "nope") for a in args]
    done = _run_cli(*filled, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "heavy: []" in done.stderr, done.stderr
