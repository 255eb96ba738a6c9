"""Which device a run uses (``distributed.device``) and the backend that follows it, on machines with and without
GPUs. A machine with GPUs is simulated by patching ``torch.cuda.is_available``/``device_count``: only the choice is
tested here (nothing touches CUDA); the CUDA runs themselves are the ``gpus``-marked tests."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from remat.cli import main
from remat.distributed import DistributedSetup
from remat.distributed.env import ProcessEnv
from remat.distributed.env import backend_for, resolve_device
from remat.errors import ConfigError
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import validate_recipe

ROOT = Path(__file__).resolve().parents[2]
TWO_LOCAL_RANKS = ProcessEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, launched=True)


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_picks_the_local_rank_gpu_when_each_rank_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    assert resolve_device("auto", ProcessEnv()) == torch.device("cuda", 0)
    assert DistributedSetup.build("single").device == torch.device("cuda", 0)  # the default is auto
    _gpus(monkeypatch, 4)
    assert resolve_device(None, TWO_LOCAL_RANKS) == torch.device("cuda", 1)


def test_auto_is_the_cpu_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    assert resolve_device("auto", TWO_LOCAL_RANKS) == torch.device("cpu")
    assert DistributedSetup.build("single").device == torch.device("cpu")


def test_auto_with_fewer_gpus_than_local_ranks_runs_on_the_cpu_and_says_why(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    _gpus(monkeypatch, 1)
    with caplog.at_level(logging.WARNING, logger="remat.distributed.env"):
        assert resolve_device("auto", TWO_LOCAL_RANKS) == torch.device("cpu")
    assert "2 local ranks but 1 CUDA device; running on the CPU (gloo)" in caplog.text
    assert backend_for(torch.device("cpu")) == "gloo"


def test_cpu_is_pinned_even_with_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 8)
    assert resolve_device("cpu", TWO_LOCAL_RANKS) == torch.device("cpu")
    setup = DistributedSetup.build("single", device="cpu")
    assert setup.device == torch.device("cpu") and setup.describe() == "single process on cpu"


def test_cuda_gets_the_local_rank_gpu_and_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 2)
    device = resolve_device("cuda", TWO_LOCAL_RANKS)
    assert device == torch.device("cuda", 1)
    assert backend_for(device) == "cpu:gloo,cuda:nccl"
    assert resolve_device(torch.device("cuda", 0), TWO_LOCAL_RANKS) == torch.device("cuda", 0)  # as given


@pytest.mark.parametrize(("gpus", "message"), [
    (0, "distributed.device: 'cuda' but torch.cuda.is_available() is False; allowed here: auto, cpu"),
    (1, "distributed.device: 'cuda' with 2 processes per node, but this node has 1 CUDA device; allowed: at most 1 "
        "processes per node on cuda, or device cpu (gloo)"),
])
def test_cuda_without_enough_gpus_is_a_config_error(gpus: int, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, gpus)
    with pytest.raises(ConfigError) as info:
        resolve_device("cuda", TWO_LOCAL_RANKS)
    assert str(info.value) == message


def test_unknown_device_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"distributed.device: got 'gpu'; allowed: auto, cpu, cuda"):
        DistributedSetup.build("single", device="gpu")


def _recipe(tmp_path: Path, **distributed: str) -> dict[str, object]:
    return {"output_dir": str(tmp_path), "model": {"preset": "tiny-llama"}, "distributed": distributed}


def test_the_recipe_key_reaches_the_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    assert validate_recipe(_recipe(tmp_path)).distributed.device == "auto"
    assert FinetuneRecipe(validate_recipe(_recipe(tmp_path))).dist.device == torch.device("cuda", 0)
    assert FinetuneRecipe(validate_recipe(_recipe(tmp_path, device="cpu"))).dist.device == torch.device("cpu")


def test_launcher_refuses_cuda_with_too_few_gpus_before_any_worker_starts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    _gpus(monkeypatch, 1)
    assert main(["finetune", str(ROOT / "examples" / "fsdp2_quickstart.yaml"), "--nproc-per-node", "2",
                 "--distributed.device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "distributed.device: 'cuda' with 2 processes per node, but this node has 1 CUDA device" in err
    assert "launching" not in err
