"""The estimate never allocates the simulated size: absurd shapes are refused up front, naming the limit; the
model's own sizes cost nothing real."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from remat.cli import main
from remat.errors import ConfigError
from remat.estimate.api import estimate_memory
from remat.estimate.limits import MAX_GRAD_ACCUMULATION, MAX_LAYERS, MAX_MICRO_BATCH_TOKENS, MAX_WORLD_SIZE
from remat.estimate.report import parse_capacity
from remat.models import ModelConfig

SRC = Path(__file__).resolve().parents[2] / "src"

# Runs the command line in a child that prints its peak RSS after it: VmHWM, its own address space's high-water mark
# in KiB (ru_maxrss would start at the parent's, pytest's, RSS: Linux carries it across exec).
_CHILD = """
import sys
from remat.cli import main
code = main(sys.argv[1:])
with open("/proc/self/status") as status:
    hwm = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
print("maxrss_kib", hwm, file=sys.stderr)
sys.exit(code)
"""


def test_an_absurd_batch_is_refused_in_one_line_without_allocating_it() -> None:
    argv = ["estimate", "--preset", "tiny-llama", "--batch-size", "100000000", "--seq-length", "16"]
    done = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == [(
        "error: batch_size x seq_length: 100000000 x 16 = 1,600,000,000 tokens per micro-batch is above the "
        "estimate's limit of 16,777,216 (2^24; the simulation holds the micro-batch's token ids for real, ~100 "
        "bytes of host memory per token); no single device holds the activations of such a micro-batch: lower "
        "batch_size or seq_length")]
    assert "Traceback" not in done.stderr
    maxrss_kib = int(lines[-1].split()[1])
    assert maxrss_kib < 1_000_000, f"the refusal used {maxrss_kib} KiB"  # the batch alone would be 38 GB


@pytest.mark.parametrize(("options", "message"), [
    ({"batch_size": MAX_MICRO_BATCH_TOKENS // 4 + 1, "seq_length": 4}, "tokens per micro-batch is above"),
    ({"grad_accumulation": MAX_GRAD_ACCUMULATION + 1}, f"grad_accumulation: 4,097 is above the estimate's limit of "
                                                       f"{MAX_GRAD_ACCUMULATION:,}"),
    ({"strategy": "fsdp2", "world_size": MAX_WORLD_SIZE * 2}, "world_size: 131,072 is above the estimate's limit"),
    ({"strategy": "ddp", "world_size": 10**9}, "world_size: 1,000,000,000 is above"),
])
def test_sizes_beyond_the_limits_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        estimate_memory("tiny-llama", **{"seq_length": 16, **options})


def test_too_many_layers_are_refused_before_building_them() -> None:
    model = ModelConfig(preset="tiny-llama", config={"num_hidden_layers": 10**6})
    with pytest.raises(ConfigError, match=rf"model.config.num_hidden_layers: 1,000,000 is above the estimate's limit "
                                          rf"of {MAX_LAYERS}"):
        estimate_memory(model, seq_length=16)


def test_a_huge_model_answers_with_a_huge_number_and_little_host_memory() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    wide = ModelConfig(preset="tiny-llama", config={"hidden_size": 2**16, "intermediate_size": 2**18,
                                                    "num_attention_heads": 256, "num_key_value_heads": 256,
                                                    "num_hidden_layers": 1})
    estimate = estimate_memory(wide, seq_length=16, target="cpu")
    assert estimate.parameters > 2**16 * 2**18 * 3  # the MLP alone: 51 billion parameters, 190 GiB in float32
    assert estimate.peak_bytes > 4 * estimate.parameters * 4  # weights, gradients and two AdamW moments
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000  # KiB


def test_micro_batches_beyond_two_are_counted_without_being_real() -> None:
    two, three = (estimate_memory("tiny-llama", batch_size=2, seq_length=64, grad_accumulation=n)
                  for n in (2, 3))
    assert three.tensor_peak_bytes - two.tensor_peak_bytes == 3 * 2 * 64 * 8  # ids, labels, positions (int64)


@pytest.mark.parametrize(("text", "nbytes"), [
    ("80G", 80 * 2**30), ("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("80 gib", 80 * 2**30), ("80g", 80 * 2**30),
    ("24576M", 24 * 2**30), ("1.5t", int(1.5 * 2**40)), ("512 kb", 512_000),
])
def test_capacities_in_slurm_and_nvidia_smi_spellings(text: str, nbytes: int) -> None:
    assert parse_capacity(text) == nbytes


def test_the_capacity_error_lists_the_units_as_written() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_capacity("80 parsecs")
    assert "B, KB, MB, GB, TB, K, M, G, T, KiB, MiB, GiB, TiB (case-insensitive" in str(caught.value)
    assert "KIb" not in str(caught.value) and "Gb" not in str(caught.value)


def test_presets_are_case_insensitive_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--preset", "TINY-Llama", "--seq-length", "16", "--target", "cpu"]) == 0
    assert "preset tiny-llama" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["directory", "under_a_file"])
def test_json_output_paths_that_cannot_be_written_are_one_line(where: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    target = tmp_path if where == "directory" else tmp_path / "file" / "e.json"
    assert main(["estimate", "--preset", "tiny-llama", "--json", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: --json: ")
    assert ("is a directory" if where == "directory" else "is under the regular file") in err


def test_json_output_under_a_missing_directory_is_created(tmp_path: Path) -> None:
    target = tmp_path / "new" / "deeper" / "e.json"
    assert main(["estimate", "--preset", "tiny-llama", "--seq-length", "16", "--target", "cpu",
                 "--json", str(target)]) == 0
    assert '"peak_bytes"' in target.read_text()
