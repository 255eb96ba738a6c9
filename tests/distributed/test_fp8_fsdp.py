"""FP8 training under FSDP2 on 2 CPU processes (gloo, ``emulate: true``): the sharded weights gathered in FP8
(``enable_fsdp_float8_all_gather``) with their scales computed after each optimizer step
(``precompute_float8_dynamic_scale_for_fsdp``) train the losses of one process with the same FP8 layers."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from processes import run_bounded
from tiny import tiny_recipe

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _losses(tmp_path: Path, name: str, distributed: dict[str, Any], fp8: dict[str, Any], *launch: str) -> list[float]:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe(
        output_dir=str(tmp_path / name), model={"dtype": "bfloat16"}, dataset={"seq_length": 64},
        step_scheduler={"max_steps": 3}, checkpoint={"enabled": False}, logging={"metrics_file": "m.jsonl"},
        distributed={"activation_checkpointing": "full", **distributed},
        fp8={"enabled": True, "emulate": True, "filter_fqns": ["lm_head"], **fp8})))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_bounded([sys.executable, "-m", "remat.cli", "finetune", str(path), *launch], env=env, cwd=tmp_path,
                       timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "fp8: 14 linear layers in FP8 (torchao, tensorwise scaling, emulated)" in proc.stderr
    assert "Failed to load" not in proc.stderr and "Enum subclass" not in proc.stderr  # torchao's import noise
    return [json.loads(line)["loss"] for line in (tmp_path / name / "m.jsonl").read_text().splitlines()
            if '"loss"' in line][:3]


def test_fsdp2_gathers_fp8_weights_and_trains_the_single_process_losses(tmp_path: Path) -> None:
    single = _losses(tmp_path, "single", {}, {})
    sharded = _losses(tmp_path, "fsdp2", {"strategy": "fsdp2"},
                      {"enable_fsdp_float8_all_gather": True, "precompute_float8_dynamic_scale_for_fsdp": True},
                      "--nproc-per-node", "2")
    assert len(single) == len(sharded) == 3
    # bfloat16 weights, gradients reduced over 2 ranks in another order: equal to bfloat16's resolution
    assert sharded == pytest.approx(single, rel=2e-3), (single, sharded)
