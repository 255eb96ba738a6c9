"""The command line starts workers through torchrun: option pass-through, detection of an existing torchrun, errors
before any worker starts, and one real `remat finetune examples/fsdp2_quickstart.yaml --nproc-per-node 2` run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from processes import descendants, end_tree, run_bounded

from remat.cli import build_parser, main
from remat.distributed.launch import LaunchOptions, check_launch_environment, share_store_off
from remat.errors import ConfigError
from remat.recipes.run_safety.run_lock import refuse_if_held
from remat.training_state.layout import checkpoint_layout, find_latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]
FSDP2_EXAMPLE = ROOT / "examples" / "fsdp2_quickstart.yaml"
TORCHRUN_ENV = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


def options(*argv: str) -> LaunchOptions:
    args, _ = build_parser().parse_known_args(["finetune", "recipe.yaml", *argv])
    return LaunchOptions.from_namespace(args)


def test_single_node_runs_standalone() -> None:
    opts = options("--nproc-per-node", "2", "--distributed.strategy", "fsdp2")
    assert opts.torchrun_args() == ["--nproc-per-node", "2", "--standalone"]
    assert opts.num_processes() == 2 and opts.requested


def test_multi_node_flags_pass_through() -> None:
    opts = options("--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node0:29500",
                   "--max-restarts", "3")
    assert opts.torchrun_args() == ["--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1",
                                    "--rdzv-endpoint", "node0:29500", "--max-restarts", "3"]
    assert opts.num_processes() == 16
    assert options("--nproc-per-node", "gpu", "--nnodes", "1:4").num_processes() is None
    assert not options().requested


def test_bad_nproc_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        options("--nproc-per-node", "0")
    assert "allowed: a positive integer or one of auto, gpu, cpu" in capsys.readouterr().err


def test_existing_torchrun_is_detected_and_not_relaunched() -> None:
    assert check_launch_environment(options("--nproc-per-node", "2"), environ={}) is True
    assert check_launch_environment(options("--nproc-per-node", "2"), environ=TORCHRUN_ENV) is False
    assert check_launch_environment(options(), environ=TORCHRUN_ENV) is False
    with pytest.raises(ConfigError, match=r"--nproc-per-node: got 4, but .* LOCAL_WORLD_SIZE=2"):
        check_launch_environment(options("--nproc-per-node", "4"), environ=TORCHRUN_ENV)


@pytest.mark.parametrize(("overrides", "message"), [
    (["--distributed.strategy", "single"],
     "distributed.strategy: 'single' runs one process, but the launch has 2 (WORLD_SIZE=2)"),
    (["--distributed.dp_size", "4"],
     "distributed.dp_size x tp_size x cp_size = 4 x 1 x 1 = 4, but the launch has 2 processes"),
    (["--distributed.cp_size", "4"],
     "distributed.dp_size x tp_size x cp_size = 1 x 1 x 4 = 4, but the launch has 2 processes"),
    (["--distributed.cp_size", "2", "--model.config.num_attention_heads", "1", "--model.config.num_key_value_heads",
      "1", "--step_scheduler.local_batch_size", "8"],
     "distributed.cp_size: 2 must divide the model's attention heads (1); allowed: a divisor of 1"),
    (["--step_scheduler.global_batch_size", "12"],
     "step_scheduler.global_batch_size: 12 is not local_batch_size (4) x dp_size (2, of 2 processes) x an integer "
     "number of accumulation steps; allowed: a multiple of 8"),
])
def test_layout_errors_come_before_any_worker_starts(overrides: list[str], message: str,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    assert main(["finetune", str(FSDP2_EXAMPLE), "--nproc-per-node", "2", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "launching" not in err


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_example_runs_on_two_processes(tmp_path: Path, remat_cache: Path) -> None:
    """Run from a directory that holds a ``yaml.py`` and a ``safetensors.py`` that would leave a marker if imported:
    the workers never import from the working directory (``python -P``), so neither runs."""
    out = tmp_path / "run"
    for shadow in ("yaml", "safetensors"):
        (tmp_path / f"{shadow}.py").write_text(f"open({str(tmp_path / ('imported-' + shadow))!r}, 'w').close()\n")
    command = [str(Path(sys.executable).parent / "remat"), "finetune", str(FSDP2_EXAMPLE), "--nproc-per-node", "2",
               "--output_dir", str(out), "--tokenizer.vocab_size", "512", "--dataset.seq_length", "64",
               "--validation_dataset.seq_length", "64", "--model.config", "{num_hidden_layers: 2}",
               "--step_scheduler.max_steps", "3", "--step_scheduler.val_every_steps", "3",
               "--step_scheduler.ckpt_every_steps", "2", "--logging.progress", "plain"]
    proc = run_bounded(command, timeout=600, cwd=tmp_path, env=os.environ)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    # Only rank 0 prints: one line per step, one setup report.
    assert [line.split(" |")[0] for line in lines if "| loss " in line] == ["step 1", "step 2", "step 3"]
    assert sum(line.startswith("distributed: fsdp2 over 2 processes (dp 2)") for line in lines) == 1
    assert sum("the maximum over the 2 ranks" in line for line in lines) == 1
    assert "global batch 16 = local 4 x dp 2 x accumulation 2" in proc.stdout
    assert f"launching: torchrun --nproc-per-node 2 --standalone --no-python {sys.executable} -P -u -m remat.cli" \
        in proc.stderr
    assert sorted(p.name for p in tmp_path.glob("imported-*")) == []
    assert "Setting OMP_NUM_THREADS" not in proc.stderr  # torchrun's banner: the launcher sets its default itself
    assert proc.stdout.count(f"recipe: {FSDP2_EXAMPLE}") == 1  # said once at the start (rank 0), not by each worker
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if row["kind"] == "train"] == [1, 2, 3]
    latest = find_latest_checkpoint(out / "checkpoints")
    assert latest is not None and latest.name == "step_3" and checkpoint_layout(latest) == "sharded"
    assert (latest / "model" / "model.safetensors").is_file()


@pytest.mark.parametrize(("flags", "message"), [
    (["--nnodes", "2", "--node-rank", "2"],
     "--node-rank: got 2, but the launch has --nnodes 2; allowed: 0 .. 1, a different rank on each node"),
    (["--nnodes", "1:3", "--node-rank", "3"], "--node-rank: got 3, but the launch has --nnodes 1:3; allowed: 0 .. 2"),
    (["--node-rank", "-1"], "--node-rank: got -1, but the launch has one node (no --nnodes); allowed: 0,"),
    (["--node-rank", "1"], "--node-rank: got 1, but the launch has one node (no --nnodes); allowed: 0,"),
    (["--master-port", "99999"], "--master-port: got 99999; allowed: a port in 1 .. 65535"),
    (["--master-port", "0"], "--master-port: got 0; allowed: a port in 1 .. 65535"),
    (["--max-restarts", "-1"], "--max-restarts: got -1; allowed: 0 or more restarts"),
    (["--nnodes", "0"], "--nnodes: got '0'; allowed: a positive number of nodes N, or MIN:MAX with 1 <= MIN <= MAX"),
    (["--nnodes", "3:2"], "--nnodes: got '3:2'; allowed: a positive number of nodes N, or MIN:MAX"),
    (["--rdzv-endpoint", "node0:"], "--rdzv-endpoint: got 'node0:', whose port '' is not a port; allowed: HOST or "
                                    "HOST:PORT (e.g. node0:29500, [::1]:29500), with a port in 1 .. 65535"),
    (["--rdzv-endpoint", "node0:99999"], "--rdzv-endpoint: got 'node0:99999', whose port '99999' is not a port"),
    (["--rdzv-endpoint", ":29500"], "--rdzv-endpoint: got ':29500', which names no host; allowed: HOST or HOST:PORT"),
    (["--rdzv-endpoint", "node 0:29500"], "--rdzv-endpoint: got 'node 0:29500', which names no host"),
])
def test_impossible_launcher_values_are_refused_in_one_line(flags: list[str], message: str,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Each value torchrun would fail on with a traceback, or wait forever with, is one line and status 2 before
    anything is read or launched (the recipe path does not even exist)."""
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("remat.distributed.launch.launch", lambda *a: pytest.fail("launched"))
    assert main(["finetune", "no-such-recipe.yaml", "--nproc-per-node", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {err.removeprefix('error: ').strip()}"]
    assert message in err


@pytest.mark.parametrize("endpoint", ["node0", "node0:29500", "10.0.0.1:1", "[::1]:29500", "[fe80::1]"])
def test_valid_endpoints_and_restarts_pass_the_checks(endpoint: str) -> None:
    opts = options("--nproc-per-node", "2", "--nnodes", "1:2", "--node-rank", "1", "--rdzv-endpoint", endpoint,
                   "--max-restarts", "0", "--master-port", "65535")
    opts.check()  # no error


def test_restarts_over_several_nodes_get_a_new_store_per_round() -> None:
    environ: dict[str, str] = {}
    assert share_store_off(options("--nnodes", "2", "--max-restarts", "1"), environ) is True
    assert environ == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    for flags, env in ((["--nnodes", "1", "--max-restarts", "3"], {}),  # one node: the workers prefix their keys
                       (["--nnodes", "2"], {}), (["--nnodes", "2", "--max-restarts", "0"], {}),
                       (["--nnodes", "1:2", "--max-restarts", "1"], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})):
        before = dict(env)
        assert share_store_off(options(*flags), env) is False
        assert env == before


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc (Linux)")
def test_workers_stop_and_save_when_the_launcher_is_killed(tmp_path: Path, remat_cache: Path) -> None:
    """kill -9 of the ``remat`` launcher: both workers notice their parent is gone, finish the step, save, release
    the run's lock and exit, instead of running on as orphans."""
    out = tmp_path / "run"
    launcher = _endless_ddp_run(out)
    lines: list[str] = []
    try:
        assert launcher.stdout is not None
        deadline = time.monotonic() + 300
        for line in launcher.stdout:
            lines.append(line)
            if line.startswith("step 2 |") or time.monotonic() > deadline:
                break
        workers = [pid for pid in descendants(launcher.pid) if "remat.cli" in _cmdline(pid)]
        assert len(workers) == 2, "".join(lines[-40:])
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        rest = launcher.stdout.read()  # the workers still write to the pipe until they end
        _all_end_within(workers, 60, rest)
    finally:
        end_tree(launcher.pid)
    assert "the launcher" in rest and "is gone: stopping after the current step" in rest
    saved = [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")]
    assert saved, rest[-3000:]
    refuse_if_held({"output_dir": out})  # the lock was released: no error


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc (Linux)")
def test_workers_still_starting_end_with_a_killed_launcher(tmp_path: Path, remat_cache: Path) -> None:
    """kill -9 of the launcher as soon as its two workers exist, while they still import and build: they watch the
    launcher from remat.cli's first lines, so both are gone within seconds (they ran on until their start-up ended,
    40 s and more, before)."""
    out = tmp_path / "run"
    launcher = _endless_ddp_run(out)
    try:
        deadline = time.monotonic() + 120
        workers: list[int] = []
        while len(workers) < 2:
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.2)
            workers = [pid for pid in descendants(launcher.pid) if "remat.cli" in _cmdline(pid)]
        time.sleep(1.0)  # into their imports
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
        _all_end_within(workers, 15)
    finally:
        end_tree(launcher.pid)


def _all_end_within(workers: list[int], seconds: float, output: str = "") -> None:
    ended = time.monotonic() + seconds
    while any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in workers):
        assert time.monotonic() < ended, f"workers {workers} still run {seconds} s after their launcher died:\n{output}"
        time.sleep(0.2)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def test_a_master_port_in_use_is_one_line_before_launching(capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr("torch.distributed.run.main", lambda *a: pytest.fail("launched"))
        assert main(["finetune", str(FSDP2_EXAMPLE), "--nproc-per-node", "2", "--master-port", str(port),
                     "--master-addr", "127.0.0.1"]) == 2
    err = capsys.readouterr().err
    assert f"error: --master-port: port {port} is already in use on this machine" in err


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc (Linux)")
def test_a_rank_whose_peer_dies_says_so_in_one_line(tmp_path: Path, remat_cache: Path) -> None:
    """kill -9 of rank 1: rank 0's next collective fails and it says so in one line, or torchrun stops it first and
    names the failed rank; no traceback either way, and the run exits non-zero."""
    out = tmp_path / "run"
    launcher = _endless_ddp_run(out)
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            if line.startswith("step 2 |"):
                break
        (victim,) = [pid for pid in descendants(launcher.pid) if "LOCAL_RANK=1\0" in _environ(pid)]
        os.kill(victim, signal.SIGKILL)
        rest = launcher.stdout.read()
        assert launcher.wait(timeout=120) != 0
    finally:
        end_tree(launcher.pid)
    # Which comes first is a race: rank 0's next collective failing (it says so in one line), or torchrun noticing
    # rank 1's death and stopping rank 0 itself (it names the failed rank); on a loaded machine either wins.
    said = "rank 0: another rank's process ended (" in rest
    stopped = "closing signal SIGTERM" in rest and "local_rank: 1" in rest and "exitcode: -9" in rest
    assert said or stopped, rest[-3000:]
    assert "Traceback" not in rest, rest[-3000:]


def _environ(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _endless_ddp_run(out: Path) -> subprocess.Popen[str]:
    """``remat finetune`` of a 1-layer ddp model on 2 processes that trains until stopped, output on one pipe."""
    command = [str(Path(sys.executable).parent / "remat"), "finetune", str(ROOT / "examples" / "ddp_quickstart.yaml"),
               "--nproc-per-node", "2", "--output_dir", str(out), "--tokenizer.vocab_size", "512",
               "--dataset.seq_length", "32", "--validation_dataset", "null", "--step_scheduler.val_every_steps", "null",
               "--step_scheduler.val_batches", "null", "--model.config", "{num_hidden_layers: 1}",
               "--step_scheduler.max_steps", "100000", "--step_scheduler.ckpt_every_steps", "100000",
               "--logging.progress", "plain"]
    return subprocess.Popen(command, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ)
