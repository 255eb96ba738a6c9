"""One writer per output_dir: a second run is refused naming the holder, a dead run's lock is taken over with a line,
and the lock is let go when a run ends (normally or not)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from processes import run_bounded

import remat
from remat.errors import ConfigError
from remat.recipes.run_safety import run_lock
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe
from remat.recipes.run_safety.run_lock import LOCK_FILE, acquire_run_locks
from test_finetune import tiny_recipe

HOLDER = Path(__file__).with_name("lock_holder.py")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "remat-cache"))


class Holder:
    """A real second process holding the run locks of some directories."""

    def __init__(self, *directories: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(remat.__file__).parents[1]),
                                                             os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, str(HOLDER), *map(str, directories)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        self.ready = self.proc.stdout.readline()
        assert self.ready.startswith("ready"), self.proc.stderr.read() if self.proc.stderr else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=60)

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        holder.stop()


def test_a_second_run_is_refused_before_building_naming_the_holder(tmp_path: Path, holders: list[Holder]) -> None:
    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 2})
    output_dir = Path(recipe["output_dir"])
    holders.append(Holder(output_dir))
    pid = holders[0].proc.pid
    job = FinetuneRecipe(validate_recipe(recipe))
    with pytest.raises(ConfigError) as err:
        job.run()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"output_dir: {output_dir.resolve()} is in use by another run (pid {pid} on "
                              f"{socket.gethostname()}, since 20")
    assert f"lock_holder.py {output_dir}" in message
    assert message.endswith("wait for it to end or stop it, or give this run another output_dir")
    assert not hasattr(job, "model")  # refused before anything was built
    assert not (output_dir / "checkpoints").exists() and not (output_dir / "metrics.jsonl").exists()
    # Once the holder has ended, the same recipe trains (its attempt follows the holder's).
    holders[0].stop()
    _, result = run_recipe(recipe)
    assert result.final_step == 2
    body = json.loads((output_dir / LOCK_FILE).read_text())
    assert (body["pid"], body["attempt"], body["released"]) == (os.getpid(), 2, True)
    assert all(json.loads(line)["attempt"] == 2 for line in (output_dir / "metrics.jsonl").read_text().splitlines())


@pytest.mark.parametrize("launch", [[], ["--nproc-per-node", "2"]], ids=["in-process", "before-torchrun"])
def test_the_cli_refuses_a_second_run_in_one_line(tmp_path: Path, holders: list[Holder], launch: list[str]) -> None:
    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 2},
                         distributed={"strategy": "ddp" if launch else "single"})
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))  # JSON is YAML
    holders.append(Holder(Path(recipe["output_dir"])))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(remat.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = run_bounded([sys.executable, "-m", "remat.cli", "finetune", str(tmp_path / "recipe.yaml"), *launch],
                       env=env, timeout=300)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: output_dir: {Path(recipe['output_dir']).resolve()} is "
                                                   f"in use by another run (pid {holders[0].proc.pid} on ")


def test_a_shared_checkpoint_dir_is_refused_too(tmp_path: Path, holders: list[Holder]) -> None:
    shared = tmp_path / "shared-checkpoints"
    holders.append(Holder(tmp_path / "first-run", shared))
    recipe = tiny_recipe(tmp_path, output_dir=str(tmp_path / "second-run"), checkpoint={"checkpoint_dir": str(shared)})
    with pytest.raises(ConfigError, match=r"^checkpoint\.checkpoint_dir: .*shared-checkpoints is in use by another "
                                          r"run \(pid \d+ .*give this run another checkpoint\.checkpoint_dir$"):
        run_recipe(recipe)
    # The output_dir lock this run took before it met the held one was let go, its body untouched (no attempt
    # counted for a refused run).
    locks = acquire_run_locks({"output_dir": tmp_path / "second-run"})
    assert (locks.attempt, locks.notes) == (1, [])
    locks.release()


def test_a_killed_runs_lock_is_taken_over_with_one_line(tmp_path: Path, holders: list[Holder],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 1})
    output_dir = Path(recipe["output_dir"])
    holder = Holder(output_dir, output_dir / "checkpoints")
    holders.append(holder)
    holder.kill9()  # the OS drops its flock; its body still names it, never marked released
    assert json.loads((output_dir / LOCK_FILE).read_text())["released"] is False
    _, result = run_recipe(recipe)
    assert result.final_step == 1
    notes = [line for line in capsys.readouterr().out.splitlines() if "taking over the lock" in line]
    assert len(notes) == 1
    assert notes[0].startswith(f"output_dir, checkpoint.checkpoint_dir: taking over the lock left by a run that did not end cleanly (pid "
                               f"{holder.proc.pid} on {socket.gethostname()}, since 20")
    assert notes[0].endswith("; no longer running)")
    assert f"lock_holder.py {output_dir}" in notes[0]


def test_a_crashed_run_lets_go_of_its_lock(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 3}, checkpoint={"enabled": False})

    def crash(job: FinetuneRecipe, record: object) -> None:
        raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        run_recipe(recipe, callbacks=[crash])
    locks = acquire_run_locks({"output_dir": Path(recipe["output_dir"])})  # free again, in this same process
    assert locks.notes == [] and locks.attempt == 2
    locks.release()


def test_without_flock_the_run_goes_on_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    def unsupported(fd: int, operation: int) -> None:
        raise OSError(37, "No locks available")  # ENOLCK, as on some network filesystems

    monkeypatch.setattr(run_lock.fcntl, "flock", unsupported)
    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 1}, checkpoint={"enabled": False})
    _, result = run_recipe(recipe)
    assert result.final_step == 1
    assert (f"output_dir: cannot lock {Path(recipe['output_dir']).resolve()} (flock is not supported there (No locks "
            "available)); going on without a lock") in capsys.readouterr().out


def run_recipe(recipe: dict[str, object], **kwargs: object) -> tuple[FinetuneRecipe, object]:
    job = FinetuneRecipe(validate_recipe(recipe), **kwargs)  # type: ignore[arg-type]
    return job, job.run()


def test_an_auto_run_is_refused_before_planning_when_another_run_holds_its_directory(
        tmp_path: Path, holders: list[Holder], capsys: pytest.CaptureFixture[str]) -> None:
    """`remat finetune` writes the run's plan file (auto_plan.json) into output_dir: never while another run holds
    it, and never for --print-config."""
    import yaml

    from remat.cli import main

    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 1},
                         distributed={"device": "cpu", "activation_checkpointing": {"mode": "auto",
                                                                                     "memory_budget": "1GiB"}})
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump(recipe))
    output_dir = Path(recipe["output_dir"])
    assert main(["finetune", str(path), "--print-config"]) == 0
    assert "plan:" in capsys.readouterr().out and not (output_dir / "auto_plan.json").exists()
    holders.append(Holder(output_dir))
    assert main(["finetune", str(path)]) == 2
    assert f"output_dir: {output_dir.resolve()} is in use by another run" in capsys.readouterr().err
    assert not (output_dir / "auto_plan.json").exists()
