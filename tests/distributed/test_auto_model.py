"""``remat.AutoModelForCausalLM.from_pretrained`` with DDP and FSDP2 setups on 2 CPU ranks (gloo), from a local
checkpoint and from a preset: the global loss and every parameter's full gradient equal one process taking the whole
batch (within 1e-5 relative: the order of floating-point sums differs), blocks wrapped exactly once, and what comes
back is the HF model (FSDP2) or the DDP wrapper around it, each carrying the plan. ``sqrt`` (segments) under FSDP2
trains too: each segment is sharded as one unit (``plan.shard_groups()``). With ``cp_size`` 2 both ranks are given
the whole batch and each call is cut to the rank's shard of every row: the mean of the ranks' losses and the
gradients are those of one process too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from auto_worker import CASES, PRESET_OVERRIDES, SEED, batch
from launches import run_torchrun
from transformers import AutoConfig, AutoModelForCausalLM

import remat

pytestmark = pytest.mark.distributed

RTOL = 1e-5
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=96, max_position_embeddings=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(SEED)
    path = tmp_path_factory.mktemp("auto-checkpoint")
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("auto-model")
    run_torchrun([str(Path(__file__).parent / "auto_worker.py"), str(out), str(checkpoint)])
    return [json.loads((out / f"auto_rank{rank}.json").read_text()) for rank in range(2)]


def one_process(source: str, checkpoint: Path) -> tuple[float, dict[str, list[float]]]:
    """Loss and [norm, sum] of each gradient of the plain model on the whole batch."""
    if source == "preset":
        torch.manual_seed(SEED)
        model = remat.build_model(remat.ModelConfig(preset="tiny-llama", config=PRESET_OVERRIDES))
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint).train()
    ids = batch()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: [p.grad.norm().item(), p.grad.sum().item()] for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_training_step_matches_one_process(case: str, reports: list[dict[str, Any]], checkpoint: Path) -> None:
    strategy, source, *_ = CASES[case]
    loss, grads = one_process(source, checkpoint)
    for report in reports:
        got = report[case]
        assert got["loss"] == pytest.approx(loss, rel=RTOL)
        assert got["grads"].keys() == grads.keys()
        actual = torch.tensor([got["grads"][name] for name in grads])
        expected = torch.tensor([grads[name] for name in grads])
        torch.testing.assert_close(actual[:, 0], expected[:, 0], rtol=RTOL, atol=0)  # norms
        torch.testing.assert_close(actual[:, 1], expected[:, 1], rtol=RTOL, atol=1e-6)  # sums (some near 0)


@pytest.mark.parametrize("case", list(CASES))
def test_checkpointing_applied_once_and_the_plan_attached(case: str, reports: list[dict[str, Any]]) -> None:
    strategy, source, policy, *_ = CASES[case]
    blocks = 3 if source == "checkpoint" else 2
    for report in reports:
        got = report[case]
        assert got["wrapped"] == got["checkpointed"] == blocks
        assert got["same_plan"] is True
        assert got["model"] == ("FSDPLlamaForCausalLM" if strategy == "fsdp2" else "LlamaForCausalLM")
        assert got["root"] == ("DistributedDataParallel" if strategy == "ddp" else got["model"])
        assert got["segments"] == ([[0, 1], [2, 2]] if policy == "sqrt" else [])
