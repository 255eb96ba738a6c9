"""DistributedSetup's validation and single-process behaviour, the tensor-parallel plan table, sharded evaluation
batches and the gradient norm: everything that needs no second process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoConfig

from remat.data import IGNORE_INDEX
from remat.distributed import DistributedSetup, clip_grad_norm
from remat.distributed.env import ProcessEnv, under_torchrun
from remat.distributed.grad_norm import total_grad_norm
from remat.distributed.config import DistributedConfig
from remat.distributed.tensor_parallel import TP_PLANS, check_divisible, tp_plan_for
from remat.errors import ConfigError
from remat.recipes.finetune import sharded_eval_batches

TORCHRUN_ENV = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize(("settings", "world_size", "message"), [
    ({"strategy": "zero3"}, 1, "distributed.strategy: got 'zero3'; allowed: 'single', 'ddp' or 'fsdp2'"),
    ({"strategy": "ddp", "tp_size": 2}, 2, "distributed.tp_size: 2 needs strategy 'fsdp2' (got 'ddp')"),
    ({"strategy": "ddp", "mixed_precision": "bfloat16"}, 2,
     "distributed.mixed_precision: 'bfloat16' needs strategy 'fsdp2' (got 'ddp'); allowed with 'ddp': null"),
    ({"strategy": "fsdp2", "mixed_precision": "fp8"}, 2,
     "distributed.mixed_precision: got 'fp8'; allowed: 'bfloat16', 'float16' or 'float32'"),
    ({"strategy": "fsdp2", "dp_size": 0}, 2, "distributed.dp_size: Input should be greater than 0 (got 0)"),
    ({"strategy": "ddp", "cp_size": 2, "tp_size": 2}, 4, "distributed.tp_size: 2 needs strategy 'fsdp2' (got 'ddp')"),
    ({"strategy": "single", "cp_size": 2}, 1,
     "distributed.cp_size: 2 needs strategy 'ddp' or 'fsdp2' (strategy 'single' runs one process)"),
    ({"strategy": "ddp", "cp_size": 4}, 2,
     "distributed.dp_size x tp_size x cp_size = 1 x 1 x 4 = 4, but the launch has 2 processes"),
    ({"strategy": "fsdp2", "tp_size": 4}, 2,
     "distributed.dp_size x tp_size x cp_size = 1 x 4 x 1 = 4, but the launch has 2 processes"),
    ({"strategy": "fsdp2", "dp_size": 2, "tp_size": 2}, 8,
     "distributed.dp_size x tp_size x cp_size = 2 x 2 x 1 = 4, but the launch has 8 processes"),
    ({"strategy": "single", "tp_size": 2}, 1,
     "distributed.tp_size: 2 needs strategy 'ddp' or 'fsdp2' (strategy 'single' runs one process)"),
    ({"strategy": "single"}, 2, "'single' runs one process, but the launch has 2"),
    ({"strategy": "fsdp2", "activation_checkpointing": "sometimes"}, 2, "distributed.activation_checkpointing"),
])
def test_invalid_settings_name_the_key(settings: dict[str, Any], world_size: int, message: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as info:
        DistributedConfig.from_settings(**settings).data_parallel_size(world_size)
    assert message in str(info.value)
    for name, value in {**TORCHRUN_ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size),
                        "LOCAL_WORLD_SIZE": str(world_size)}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:  # the Python edge checks the same rules, in the same words
        DistributedSetup.build(**settings, device="cpu")
    assert message in str(info.value)


def test_data_parallel_size_is_derived_from_the_world_size() -> None:
    def dp(world_size: int, **settings: Any) -> int:
        return DistributedConfig.from_settings(**settings).data_parallel_size(world_size)

    assert dp(8, strategy="fsdp2") == 8 and dp(8, strategy="fsdp2", tp_size=2) == 4
    assert dp(2, strategy="ddp", dp_size=2) == 2 and dp(1, strategy="single") == 1


def test_process_env_reads_torchrun_variables() -> None:
    env = ProcessEnv.from_environ(TORCHRUN_ENV)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.launched) == (3, 1, 4, 2, True)
    assert ProcessEnv.from_environ({}) == ProcessEnv()
    assert under_torchrun(TORCHRUN_ENV) and not under_torchrun({"RANK": "0"})


@pytest.mark.parametrize(("env", "message"), [
    (TORCHRUN_ENV | {"RANK": "abc"}, "environment: RANK='abc' is not a process count or rank"),
    (TORCHRUN_ENV | {"WORLD_SIZE": "0"}, "environment: WORLD_SIZE=0 is impossible with WORLD_SIZE=0"),
    (TORCHRUN_ENV | {"LOCAL_RANK": "-1"}, "environment: LOCAL_RANK=-1 is impossible with WORLD_SIZE=4 and "
                                          "LOCAL_WORLD_SIZE=2; allowed: 0 .. 1"),
    (TORCHRUN_ENV | {"RANK": "4"}, "environment: RANK=4 is impossible with WORLD_SIZE=4"),
    (TORCHRUN_ENV | {"LOCAL_WORLD_SIZE": "8"}, "environment: LOCAL_WORLD_SIZE=8 is impossible"),
    ({"WORLD_SIZE": "2"}, "environment: WORLD_SIZE=2 asks for several processes, but RANK, LOCAL_RANK, "
                          "LOCAL_WORLD_SIZE are not set"),
    ({"WORLD_SIZE": "2\x1b[31m"}, r"environment: WORLD_SIZE='2\\x1b[31m' is not a process count or rank"),
    # partial sets that are not one process's values (each trained as one process before, exit 0)
    ({"WORLD_SIZE": "0", "RANK": "0"}, "environment: WORLD_SIZE=0 without LOCAL_RANK, LOCAL_WORLD_SIZE: no launcher"),
    ({"LOCAL_RANK": "-1", "RANK": "0", "WORLD_SIZE": "1"}, "environment: LOCAL_RANK=-1 without LOCAL_WORLD_SIZE"),
    ({"RANK": "1", "WORLD_SIZE": "1"}, "environment: RANK=1 without LOCAL_RANK, LOCAL_WORLD_SIZE"),
    ({"WORLD_SIZE": "-3"}, "environment: WORLD_SIZE=-3 without RANK, LOCAL_RANK, LOCAL_WORLD_SIZE"),
])
def test_launcher_variables_that_make_no_sense_are_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ProcessEnv.from_environ(env)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    assert ProcessEnv.from_environ({"WORLD_SIZE": "1"}) == ProcessEnv()  # set by some tools for one process
    assert ProcessEnv.from_environ({"RANK": "0", "LOCAL_RANK": "0"}) == ProcessEnv()


def test_single_strategy_under_torchrun_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="'single' runs one process, but the launch has 4"):
        DistributedSetup.build("single")


def test_single_process_setup_is_a_pass_through() -> None:
    setup = DistributedSetup.build("single", activation_checkpointing="full", device="cpu")
    assert not setup.is_distributed and setup.is_main_process and setup.dp_rank == 0 and setup.dp_group is None
    assert setup.sum_over_dp([1.5, 2.0]) == [1.5, 2.0] and setup.any_rank(True) and not setup.any_rank(False)
    assert setup.describe() == "single process on cpu"
    block = nn.Linear(4, 4)
    root = setup.parallelize(_TinyStack(block))
    assert isinstance(root, _TinyStack) and setup.root is root and setup.plan is not None and len(setup.plan) == 2
    with setup.gradient_sync(enabled=False):
        root(torch.ones(1, 4)).sum().backward()
    assert block.weight.grad is not None  # no wrapper, nothing deferred


def test_parallelize_root_must_contain_the_model() -> None:
    setup = DistributedSetup.build("single", device="cpu")
    with pytest.raises(ValueError, match="`root` must contain `model`"):
        setup.parallelize(_TinyStack(nn.Linear(4, 4)), root=nn.Linear(2, 2))


class _TinyStack(nn.Module):
    def __init__(self, first: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([first, nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_tensor_parallel_plan_is_known_for_listed_families_only() -> None:
    llama = AutoConfig.for_model("llama", num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    assert tp_plan_for(llama)["self_attn.o_proj"] == "rowwise" and "mistral" in TP_PLANS
    check_divisible(llama, 2)
    with pytest.raises(ConfigError, match=r"tp_size: 4 does not divide the model's num_key_value_heads=2"):
        check_divisible(llama, 4)
    for model_type in ("gpt2", "qwen3"):  # no q/k/v projections; per-head q/k norms shared by all heads
        with pytest.raises(ConfigError, match=rf"no known plan for model_type '{model_type}'; allowed: model types "):
            tp_plan_for(AutoConfig.for_model(model_type))


def test_sharded_eval_batches_cover_every_row_once_in_step() -> None:
    rows = [{"input_ids": torch.full((3,), i), "labels": torch.full((3,), i)} for i in range(10)]
    per_rank = [list(sharded_eval_batches(rows, 2, rank=r, world_size=2)) for r in range(2)]
    assert [len(batches) for batches in per_rank] == [3, 3]  # ranks stay in step
    seen = [int(v) for batches in zip(*per_rank) for batch in batches
            for v, labels in zip(batch["input_ids"][:, 0], batch["labels"][:, 0]) if labels != IGNORE_INDEX]
    assert seen == list(range(10))
    filler = per_rank[1][2]
    assert filler["labels"].eq(IGNORE_INDEX).all() and filler["input_ids"].shape == (1, 3)
    capped = list(sharded_eval_batches(rows, 2, rank=0, world_size=2, max_batches=2))
    assert [b["input_ids"][:, 0].tolist() for b in capped] == [[0, 1], [4, 5]]


def test_grad_norm_matches_torch_and_clips() -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7)), nn.Parameter(torch.randn(2))]
    for p in params[:2]:
        p.grad = torch.randn_like(p) * 3
    expected = torch.nn.utils.get_total_norm([p.grad for p in params[:2]])
    assert torch.equal(total_grad_norm(params), expected)
    assert total_grad_norm(params, norm_type=float("inf")) == max(p.grad.abs().max() for p in params[:2])
    before = [p.grad.clone() for p in params[:2]]
    assert clip_grad_norm(params, None) == pytest.approx(float(expected))
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))
    assert clip_grad_norm(params, 1.0) == pytest.approx(float(expected))
    assert float(total_grad_norm(params)) == pytest.approx(1.0, rel=1e-5)
    assert float(total_grad_norm([])) == 0.0
