"""`remat estimate --cp-size N` and ``estimate_memory(..., cp_size=N)``: one context-parallel rank's peak (its shard
of each row), the longest row N ranks train, and the sizes that cannot be split refused in one line. That the
estimate equals each rank's tracked peak of a real ``cp_size`` 2 run is checked in
tests/distributed/test_context_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remat.cli import main
from remat.errors import ConfigError
from remat.estimate.api import estimate_memory
from remat.estimate.settings import StepSettings

STEP = StepSettings(batch_size=1, seq_length=1024, policy="full", loss="fused", target="cpu")


def test_a_context_parallel_rank_holds_about_its_share_of_the_activations() -> None:
    """Measured: the full policy's kept block inputs halve (16.3 -> 8.4 MB at the peak) under ddp x cp 2; fsdp2 over
    dp 1 x cp 2 shards the parameters as dp 2 does, with a lower peak (74.9 against 97.2 MB)."""
    one = estimate_memory("tiny-llama", STEP)
    ddp = estimate_memory("tiny-llama", STEP, strategy="ddp", world_size=2, cp_size=2)
    assert ddp.breakdown["activations"] < 0.55 * one.breakdown["activations"]
    assert ddp.breakdown["parameters"] == one.breakdown["parameters"]
    dp2 = estimate_memory("tiny-llama", STEP, strategy="fsdp2", world_size=2)
    cp2 = estimate_memory("tiny-llama", STEP, strategy="fsdp2", world_size=2, cp_size=2)
    assert cp2.breakdown["parameters"] == dp2.breakdown["parameters"] < 0.6 * one.breakdown["parameters"]
    assert cp2.peak_bytes < 0.8 * dp2.peak_bytes


def test_cli_cp_size_alone_means_fsdp2_over_that_many_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--preset", "tiny-llama", "--batch-size", "1", "--seq-length", "1000", "--target", "cpu",
                 "--cp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "fsdp2 over 2 ranks (dp 1 x cp 2: one rank's peak, its 500-token shard of each row)" in out


def test_cli_longest_with_cp_size_answers_for_the_group(tmp_path: Path) -> None:
    answers = []
    for cp_size in ("1", "2"):
        out = tmp_path / f"cp{cp_size}.json"
        assert main(["estimate", "--preset", "tiny-llama", "--target", "cpu", "--loss", "fused", "--policy", "full",
                     "--longest", "--fits", "200MiB", "--window-start", "4096", "--granularity", "256", "--jobs", "1",
                     "--cp-size", cp_size, "--json", str(out)]) == 0
        answers.append(json.loads(out.read_text())["longest_seq_length"])
    assert answers[1] > 1.5 * answers[0]


@pytest.mark.parametrize(("options", "message"), [
    ({"strategy": "fsdp2", "world_size": 3, "cp_size": 3}, r"^distributed.cp_size: 3 must divide the model's "
                                                           r"attention heads \(4\); allowed: a divisor of 4$"),
    ({"strategy": "fsdp2", "world_size": 4, "cp_size": 3}, r"^cp_size: 3 does not divide world_size 4"),
    ({"strategy": "single", "cp_size": 2, "world_size": 2}, r"world_size: 2 needs strategy 'ddp' or 'fsdp2'"),
])
def test_sizes_that_cannot_be_split_are_one_line(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        estimate_memory("tiny-llama", STEP, **options)  # type: ignore[arg-type]
