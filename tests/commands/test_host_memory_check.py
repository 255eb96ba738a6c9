"""The host-memory check of an offloading recipe, before training: needed bytes (the estimate's host peak per rank,
times the node's ranks) against the available host memory (monkeypatched here)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from remat.commands.host_memory import check_offload_host_memory, checked_before_launch
from remat.errors import ConfigError
from remat.recipes.loader import validate_recipe

BATCH, SEQ, HIDDEN, LAYERS = 2, 1024, 256, 4  # tiny-llama: each block input is 2 MiB in fp32
PER_RANK = LAYERS * BATCH * SEQ * HIDDEN * 4  # {mode: full, offload: true} sends every block's input to the host


def _recipe(tmp_path: Path, *, device: str = "cuda", policy: Any = None, world_size: int = 1) -> Any:
    return validate_recipe({
        "output_dir": str(tmp_path),
        "model": {"preset": "tiny-llama"},
        "dataset": {"seq_length": SEQ},
        "step_scheduler": {"global_batch_size": BATCH * world_size, "local_batch_size": BATCH, "max_steps": 1},
        "loss_fn": {"_target_": "remat.loss.FusedLinearCrossEntropy"},
        "distributed": {"activation_checkpointing": policy or {"mode": "full", "offload": True}, "device": device,
                        "strategy": "single" if world_size == 1 else "ddp"},
        "checkpoint": {"enabled": False},
    })


def test_too_little_host_memory_is_one_error_naming_needed_and_available(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("remat.memory.host.available_host_bytes", lambda: 3 * PER_RANK)
    with pytest.raises(ConfigError) as err:
        check_offload_host_memory(_recipe(tmp_path, world_size=4), local_ranks=4, world_size=4)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("distributed.activation_checkpointing: offloading activations needs 0.03 GiB of host "
                              "memory (4 ranks on this node x 0.01 GiB;")
    assert f"{4 * PER_RANK:,} bytes) but 0.02 GiB ({3 * PER_RANK:,} bytes) is available" in message
    assert "fewer tokens per micro-batch" in message and "no offload" in message and "more nodes" in message


def test_a_run_that_fits_logs_the_host_bytes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="remat.commands.host_memory"):
        needed = check_offload_host_memory(_recipe(tmp_path, world_size=2), local_ranks=2, world_size=2,
                                           available=2 * PER_RANK)
    assert needed == 2 * PER_RANK  # exactly what fits
    assert "activation offload will hold at most 0.02 GiB of host memory on this node (2 ranks" in caplog.text


@pytest.mark.parametrize(("device", "policy"), [("cpu", None), ("cuda", "full")])
def test_nothing_to_check_on_the_cpu_or_without_offload(tmp_path: Path, device: str, policy: Any) -> None:
    cfg = _recipe(tmp_path, device=device, policy=policy, world_size=8)
    assert check_offload_host_memory(cfg, local_ranks=8, world_size=8, available=0) == 0


def test_remat_finetune_refuses_before_building_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main

    monkeypatch.setattr("remat.memory.host.available_host_bytes", lambda: 1024)
    recipe = tmp_path / "offload.yaml"
    recipe.write_text(f"model: {{preset: tiny-llama}}\ndataset: {{seq_length: {SEQ}}}\n"
                      f"step_scheduler: {{global_batch_size: {BATCH}, local_batch_size: {BATCH}, max_steps: 1}}\n"
                      "distributed: {activation_checkpointing: {mode: full, offload: true}, device: cuda}\n"
                      f"output_dir: {tmp_path / 'out'}\ncheckpoint: {{enabled: false}}\n")
    assert main(["finetune", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "offloading activations needs 0.01 GiB of host memory (1 rank on this node" in err
    assert "but 0.00 GiB (1,024 bytes) is available" in err
    assert not (tmp_path / "out").exists()  # refused before the run made anything


def test_workers_of_a_checked_launch_do_not_check_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's verdict is recorded beside the plan in the run's directory (no environment variable) and read
    by its own workers only: its descendants, of the same recipe, world size and ranks on the node."""
    import json
    import os

    from remat.commands.host_memory import check_in_worker

    monkeypatch.setattr("remat.memory.host.available_host_bytes", lambda: 10 * PER_RANK)
    cfg = _recipe(tmp_path, world_size=2)
    verdict = tmp_path / "host_memory.json"
    with checked_before_launch(cfg, local_ranks=2, world_size=2):
        saved = json.loads(verdict.read_text())
        assert [entry["needed_bytes"] for entry in saved["hosts"].values()] == [2 * PER_RANK]
        monkeypatch.setattr("remat.memory.host.available_host_bytes", lambda: 0)
        with pytest.raises(ConfigError, match="offloading activations needs"):
            check_in_worker(cfg, local_ranks=2, world_size=2)  # this process is the launcher, not its descendant
        monkeypatch.setattr("remat.commands.host_memory._ancestors", lambda: {os.getpid()})  # as a worker sees it
        check_in_worker(cfg, local_ranks=2, world_size=2)  # recorded by its launcher: no second estimate, no error
        with pytest.raises(ConfigError, match="offloading activations needs"):
            check_in_worker(cfg, local_ranks=1, world_size=2)  # other ranks on the node: checked again
        with pytest.raises(ConfigError, match="offloading activations needs"):
            check_in_worker(_recipe(tmp_path, world_size=4), local_ranks=2, world_size=4)  # another recipe / size
    assert not verdict.exists()  # removed after the launch
    with pytest.raises(ConfigError, match="offloading activations needs"):
        check_in_worker(cfg, local_ranks=2, world_size=2)


def test_a_planted_verdict_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verdict file that is a link, or that names a launcher which is not this worker's ancestor, is ignored."""
    import json
    import os
    import socket

    from remat.commands.host_memory import _ancestors, _fingerprint, check_in_worker

    assert os.getppid() in _ancestors() and os.getpid() not in _ancestors()
    monkeypatch.setattr("remat.memory.host.available_host_bytes", lambda: 0)
    cfg = _recipe(tmp_path, world_size=2)
    entry = {"local_ranks": 2, "needed_bytes": 1, "launcher_pid": os.getpid()}
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"fingerprint": _fingerprint(cfg, 2), "hosts": {socket.gethostname(): entry}}))
    (tmp_path / "host_memory.json").symlink_to(outside)
    monkeypatch.setattr("remat.commands.host_memory._ancestors", lambda: {os.getpid()})
    with pytest.raises(ConfigError, match="offloading activations needs"):
        check_in_worker(cfg, local_ranks=2, world_size=2)
    (tmp_path / "host_memory.json").unlink()
    (tmp_path / "host_memory.json").write_text(outside.read_text())
    monkeypatch.setattr("remat.commands.host_memory._ancestors", lambda: {1234567})  # an earlier launcher
    with pytest.raises(ConfigError, match="offloading activations needs"):
        check_in_worker(cfg, local_ranks=2, world_size=2)
