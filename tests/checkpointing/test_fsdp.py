"""FSDP2 `fully_shard` applied after checkpointing (one process, gloo): gradients equal the unsharded run; segments
need their blocks sharded as one unit, which `CheckpointPlan.shard_groups()` says, and fail clearly otherwise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from ckpt_models import batch, step_grads, tiny_model

from remat.checkpointing import apply_activation_checkpointing
from remat.errors import CheckpointingError

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.fixture(scope="module", autouse=True)
def one_process_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _shard(model: torch.nn.Module, groups: tuple[tuple[str, ...], ...]) -> None:
    from torch.distributed.fsdp import fully_shard

    modules = dict(model.named_modules())
    for group in groups:
        fully_shard([modules[name] for name in group])
    fully_shard(model)


@pytest.mark.parametrize("policy", ["full", "selective", "mlp", "offload", "sqrt", {"every_n_layers": 2}], ids=str)
def test_fully_shard_after_checkpointing(policy: object) -> None:
    model = tiny_model("llama")
    ids = batch()
    expected = step_grads(model, ids)
    plan = apply_activation_checkpointing(model, policy)
    groups = plan.shard_groups()
    assert len(groups) == (2 if policy == "sqrt" else 4)
    _shard(model, groups)
    assert type(model.model.layers[0]).__name__ == "FSDPLlamaDecoderLayer"
    actual = step_grads(model, ids)
    for name in expected:
        torch.testing.assert_close(actual[name].full_tensor(), expected[name], rtol=0, atol=0)


def test_segments_sharded_block_by_block_fail_clearly() -> None:
    model = tiny_model("llama")
    plan = apply_activation_checkpointing(model, "sqrt")
    _shard(model, tuple((layer.name,) for layer in plan.layers))
    ids = batch()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    with pytest.raises(CheckpointingError, match=r"segment 2-3: the parameters of .*LlamaDecoderLayer are sharded"):
        loss.backward()
