"""Process-group setup ends a hang with one clear error: a rank that never arrives, the setup watchdog, and the store
prefix each torchrun restart joins under (`remat.distributed.rendezvous`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

import remat

from remat.distributed.rendezvous import WATCHDOG_EXIT_CODE, restart_store
from remat.distributed import DistributedSetup
from remat.errors import ConfigError, DistributedSetupError

from dist_recipes import tiny_recipe
from processes import run_bounded


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _alone_as(rank: int, port: int) -> dict[str, str]:
    """The environment torchrun would give ``rank`` of 2, without the other rank ever starting."""
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(Path(remat.__file__).parents[1])}  # this checkout's remat, whatever the cwd


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_that_never_arrives_ends_the_setup_with_one_line(tmp_path: Path, remat_cache: Path) -> None:
    """Rank 0 alone waits for its peer in the store it hosts: ``remat finetune`` stops after the limit with status 2
    and one line naming the ranks, the address and ``distributed.init_timeout_s``."""
    rank = 0
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(tmp_path / "run", strategy="ddp", max_steps=2)))
    port = _free_port()
    start = time.monotonic()
    proc = run_bounded([sys.executable, "-m", "remat.cli", "finetune", str(recipe), "--distributed.init_timeout_s",
                        "3"], timeout=300, env=_alone_as(rank, port), cwd=tmp_path)
    elapsed = time.monotonic() - start
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith(f"error: distributed setup: rank {rank} of 2 could not join the process group at "
                                f"127.0.0.1:{port} within distributed.init_timeout_s=3: ")
    assert "--node-rank (0 .. nnodes-1)" in errors[0] and ".." not in errors[0].split("(0")[0]
    assert elapsed < 120, f"took {elapsed:.0f} s"  # imports included; the wait itself is 3 s


def test_rank_1_without_rank_0_finds_no_store_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    for name, value in _alone_as(1, port).items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(DistributedSetupError) as caught:
        DistributedSetup.build(strategy="ddp", device="cpu", init_timeout_s=2)
    assert time.monotonic() - start < 30
    assert not dist.is_initialized()
    assert str(caught.value).startswith(f"distributed setup: rank 1 of 2 could not join the process group at "
                                        f"127.0.0.1:{port} within distributed.init_timeout_s=2: ")


def test_the_watchdog_ends_a_wait_that_outlasts_the_limit(tmp_path: Path) -> None:
    """A wait Python cannot interrupt (here a sleep) is ended by the watchdog: status 2, the message, soon."""
    code = ("import time\nfrom remat.distributed.rendezvous import setup_deadline\n"
            "print(time.monotonic(), flush=True)\n"
            "with setup_deadline(1.0, 'distributed setup: stuck'):\n    time.sleep(60)\nprint('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    ended = time.monotonic()
    assert proc.returncode == WATCHDOG_EXIT_CODE == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: distributed setup: stuck"
    assert "not reached" not in proc.stdout
    # Timed from the block's start in the child (the system-wide monotonic clock), so a slow `import torch` on a
    # busy machine does not count: the watchdog ends the 60 s sleep after its 1 s limit.
    assert ended - float(proc.stdout.split()[0]) < 30


def test_the_watchdog_stays_quiet_when_the_setup_finishes() -> None:
    """In a child process: a watchdog that fired anyway would end it (status 2), not pytest."""
    code = ("import time\nfrom remat.distributed.rendezvous import setup_deadline\n"
            "with setup_deadline(0.2, 'never printed'):\n    pass\ntime.sleep(0.6)\nprint('still alive')\n")
    proc = run_bounded([sys.executable, "-c", code], timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "still alive", proc.stderr
    assert "never printed" not in proc.stderr


def test_each_restart_joins_under_its_own_prefix_on_one_node() -> None:
    """torchrun's shared store holds the previous generation's keys; a restart writes and reads under
    ``remat/restart_<n>/``, so it never sees them."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "1", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port)}
    server.set("default_pg/0//cpu//rank_1", b"address of the dead generation")
    store = restart_store(env, timeout=timedelta(seconds=5))
    assert store is not None
    assert not store.check(["default_pg/0//cpu//rank_1"])
    store.set("rank_1", b"new")
    assert server.get("remat/restart_1/rank_1") == b"new"
    assert restart_store({**env, "WORLD_SIZE": "4"}) is None  # two nodes: restart counts may differ between them
    assert restart_store({**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # a store per round already


@pytest.mark.parametrize(("init", "collective", "message"), [
    (0, None, "distributed.init_timeout_s: Input should be greater than or equal to 1 (got 0)"),
    (True, None, "distributed.init_timeout_s: true or false is not a number of seconds; allowed: a number, at least 1 "
                 "(got True)"),
    (10, -1, "distributed.timeout_s: Input should be greater than or equal to 1 (got -1)"),
])
def test_timeouts_are_checked(init: float, collective: float | None, message: str) -> None:
    with pytest.raises(ConfigError) as info:  # the Python edge: the recipe's rules, one line naming the key
        DistributedSetup.build(device="cpu", init_timeout_s=init, timeout_s=collective)
    assert str(info.value) == message
    assert DistributedSetup.build(device="cpu", init_timeout_s=600, timeout_s=60).device.type == "cpu"
