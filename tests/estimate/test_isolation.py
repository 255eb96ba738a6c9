"""From a process that joined a process group (a torchrun worker), an estimate or a plan of a step with FSDP2 or
context parallelism runs in a child process (`remat._child`) and answers what it answers outside one.
Planning ``auto`` on 4 context-parallel ranks goes this way in tests/distributed/test_context_parallel.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist
from tiny import tiny_recipe

from remat import estimate_memory, plan_activation_checkpointing
from remat.errors import ConfigError
from remat._child import call_in_child, child_environment, needs_fresh_process
from remat.estimate.api import estimate_memory as estimate_function

STEP = {"batch_size": 2, "seq_length": 64, "strategy": "fsdp2", "world_size": 2, "policy": "full", "target": "cpu"}


@pytest.fixture()
def joined(tmp_path) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """This test process as the one rank of a gloo process group, as a torchrun worker is."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_only_a_step_with_its_own_fake_process_group_needs_a_child(joined: None) -> None:
    assert needs_fresh_process("fsdp2", 1) and needs_fresh_process("ddp", 2)
    assert not needs_fresh_process("ddp", 1) and not needs_fresh_process("single", 1)


def test_outside_a_process_group_nothing_needs_a_child() -> None:
    assert not dist.is_initialized()
    assert not needs_fresh_process("fsdp2", 2)


def test_an_fsdp2_estimate_inside_a_process_group_equals_the_one_outside(tmp_path) -> None:  # type: ignore[no-untyped-def]
    outside = estimate_memory("tiny-llama", **STEP)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        inside = estimate_memory("tiny-llama", **STEP)
    finally:
        dist.destroy_process_group()
    assert inside.peak_bytes == outside.peak_bytes
    assert inside.breakdown == outside.breakdown and inside.phase_peaks == outside.phase_peaks


def test_an_fsdp2_recipe_is_planned_inside_a_process_group(joined: None) -> None:
    """`plan_activation_checkpointing` of a recipe goes through `plan_recipe`, which runs in the child too; its
    budget, already in bytes, is passed on as bytes."""
    from remat.recipes.loader import validate_recipe

    cfg = validate_recipe(tiny_recipe(distributed={"strategy": "fsdp2", "dp_size": 2, "device": "cpu"}))
    plan = plan_activation_checkpointing(cfg, memory_budget="200MiB")
    assert plan.peak_bytes <= 200 * 2**20 and plan.policy.describe() == "none"


def test_the_childs_config_error_is_raised_here_with_its_message() -> None:
    with pytest.raises(ConfigError, match="no-such-model"):
        call_in_child(estimate_function, "no-such-model")


def test_a_child_runs_only_remats_marked_functions() -> None:
    import os

    from remat.planner.api import plan_recipe_auto

    with pytest.raises(ValueError, match="system is not a function of remat marked child_call"):
        call_in_child(os.system, "true")
    with pytest.raises(ValueError, match="plan_recipe_auto is not a function of remat marked child_call"):
        call_in_child(plan_recipe_auto, None)


def test_the_child_refuses_an_unmarked_target_sent_to_it() -> None:
    """The mark is checked in the child too: a pickled request naming any other function is refused there."""
    import pickle
    import subprocess
    import sys

    from remat._child import SAFE_PYTHON_FLAGS

    for target in ("os:system", "remat.planner.api:plan_recipe_auto"):
        proc = subprocess.run([sys.executable, *SAFE_PYTHON_FLAGS, "-m", "remat._child"],
                              input=pickle.dumps((target, ("true",), {})), capture_output=True, env=child_environment(),
                              check=False, timeout=120)
        assert proc.returncode == 1 and not proc.stdout
        assert b"is not a function of remat marked child_call" in proc.stderr


def test_the_child_joins_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.setenv(name, "1")
    env = child_environment()
    assert not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & env.keys()
    assert env["PYTHONPATH"]
