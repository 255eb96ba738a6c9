"""Checkpoints are data: a planted sharded (DCP) step whose ``.metadata`` or entries are crafted pickles runs nothing
and is skipped for the intact older step; a marker naming paths outside its checkpoint is never followed; a FIFO or a
link in a checkpoint's place never blocks or leaks a read."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from processes import within
from torch import nn

from remat.errors import ConfigError
from remat.training_state.data_only import UnsafeCheckpointError
from remat.training_state.layout import COMPLETE_MARKER, write_marker
from remat.training_state.sharded import load_sharded_checkpoint, save_sharded_checkpoint
from remat.training_state.verify import load_newest_verified, verify_checkpoint


class _Writes:
    """Unpickled, it would create the file at `path` (what a planted checkpoint tries)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (os.system, (f"touch {self.path}",))


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture
def two_steps(tmp_path: Path) -> Path:
    """A checkpoint root with sharded step_1 and step_2 of a tiny model (one process: DCP without a group)."""
    model, optimizer = _model_and_optimizer()
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_sharded_checkpoint(root, step, model=model, optimizer=optimizer, train_state={"step": step},
                                export_model=False)
    return root


def _reseal(step_dir: Path, step: int) -> None:
    """Rewrite the marker so that every hash matches the planted files (whoever plants a step can do this)."""
    (step_dir / COMPLETE_MARKER).unlink()
    write_marker(step_dir, step, peft=False, layout="sharded", extra={"world_size": 1})


def _load(path: Path) -> dict[str, object]:
    model, optimizer = _model_and_optimizer()
    return load_sharded_checkpoint(path, model=model, optimizer=optimizer, verify=False)


def test_a_planted_dcp_metadata_runs_nothing_and_resume_falls_back(two_steps: Path, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    marker = tmp_path / "ran"
    step_2 = two_steps / "step_2"
    (step_2 / "dcp" / ".metadata").write_bytes(pickle.dumps(_Writes(marker)))
    _reseal(step_2, 2)
    assert "os.system" in str(verify_checkpoint(step_2)) or "posix.system" in str(verify_checkpoint(step_2))
    with caplog.at_level("WARNING"):
        path, state = load_newest_verified(two_steps, _load)
    assert not marker.exists()
    assert path.name == "step_1" and state == {"step": 1}
    assert any("skipping checkpoint" in r.message and "DCP metadata never holds" in r.message for r in caplog.records)


def test_the_reader_itself_refuses_a_planted_metadata(two_steps: Path, tmp_path: Path) -> None:
    """Without verification (a caller that skips it), DCP's own read of the metadata still constructs nothing."""
    marker = tmp_path / "ran"
    (two_steps / "step_2" / "dcp" / ".metadata").write_bytes(pickle.dumps(_Writes(marker)))
    _reseal(two_steps / "step_2", 2)
    with pytest.raises(UnsafeCheckpointError, match="DCP metadata never holds"):
        _load(two_steps / "step_2")
    assert not marker.exists()


def test_a_planted_non_tensor_entry_runs_nothing(two_steps: Path, tmp_path: Path) -> None:
    """An entry DCP stores as bytes (the optimizer's lr) holding a pickle that names code: refused by weights-only
    loading, where torch's default planner would unpickle it fully."""
    from remat.training_state.data_only import read_metadata

    step_2 = two_steps / "step_2"
    metadata = read_metadata(step_2 / "dcp")
    (info,) = [s for i, s in metadata.storage_data.items() if i.fqn == "optimizer.param_groups.0.lr"]
    shard = step_2 / "dcp" / info.relative_path
    data = bytearray(shard.read_bytes())
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save(_Writes(marker), buffer)
    payload = bytearray(buffer.getvalue())
    # Put the payload at the end of the shard and point the entry at it.
    info.offset, info.length = len(data), len(payload)
    shard.write_bytes(bytes(data + payload))
    with open(step_2 / "dcp" / ".metadata", "wb") as handle:
        pickle.dump(metadata, handle)
    _reseal(step_2, 2)
    assert verify_checkpoint(step_2) is None  # the metadata is genuine: only the entry's bytes are hostile
    with pytest.raises(UnsafeCheckpointError, match="optimizer.param_groups.0.lr.*weights-only"):
        _load(step_2)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../../outside.txt", "/etc/hostname", "dcp/../../../outside.txt", ""])
def test_a_marker_naming_a_path_outside_its_checkpoint_is_refused_unread(two_steps: Path, name: str) -> None:
    step_2 = two_steps / "step_2"
    outside = two_steps.parent / "outside.txt"
    outside.write_text("not the run's\n")
    marker = json.loads((step_2 / COMPLETE_MARKER).read_text())
    marker["files"][name] = {"size": outside.stat().st_size, "sha256": "0" * 64}
    (step_2 / COMPLETE_MARKER).write_text(json.dumps(marker))
    before = outside.stat().st_atime_ns
    reason = verify_checkpoint(step_2)
    assert reason is not None and "outside the checkpoint" in reason
    assert outside.stat().st_atime_ns == before


def test_a_linked_file_or_folder_in_a_checkpoint_is_refused(two_steps: Path, tmp_path: Path) -> None:
    step_2 = two_steps / "step_2"
    victim = tmp_path / "victim"
    shutil.copytree(step_2 / "dcp", victim)
    shutil.rmtree(step_2 / "dcp")
    (step_2 / "dcp").symlink_to(victim, target_is_directory=True)
    reason = verify_checkpoint(step_2)
    assert reason is not None and "outside the checkpoint" in reason
    train_state = step_2 / "train_state.json"
    (step_2 / "dcp").unlink()
    shutil.copytree(victim, step_2 / "dcp")
    (tmp_path / "state.json").write_text(train_state.read_text())
    train_state.unlink()
    train_state.symlink_to(tmp_path / "state.json")
    reason = verify_checkpoint(step_2)
    assert reason == "train_state.json is a symbolic link; a checkpoint holds regular files only"


def test_a_folder_link_that_stays_inside_the_checkpoint_and_a_linked_step_directory_are_refused(
        two_steps: Path, tmp_path: Path) -> None:
    """A link never makes a checkpoint: not a folder linked to another folder of the same checkpoint (which stays
    inside it once resolved), not a step directory that is itself a link to a copy elsewhere."""
    step_2 = two_steps / "step_2"
    shutil.move(step_2 / "dcp", step_2 / "elsewhere")
    (step_2 / "dcp").symlink_to("elsewhere", target_is_directory=True)
    reason = verify_checkpoint(step_2)
    assert reason is not None and "outside the checkpoint, behind the symbolic link dcp" in reason
    (step_2 / "dcp").unlink()
    shutil.move(step_2 / "elsewhere", step_2 / "dcp")
    assert verify_checkpoint(step_2) is None
    shutil.move(step_2, tmp_path / "copy")
    step_2.symlink_to(tmp_path / "copy", target_is_directory=True)
    reason = verify_checkpoint(step_2)
    assert reason is not None and "the checkpoint directory is a symbolic link" in reason


def test_fifos_in_a_checkpoint_never_block(two_steps: Path) -> None:
    """A FIFO as the marker, as the latest pointer or as a checkpoint file: each read returns at once."""
    with within(10):
        _fifos_never_block(two_steps)


def _fifos_never_block(two_steps: Path) -> None:
    step_2 = two_steps / "step_2"
    (step_2 / "train_state.json").unlink()
    os.mkfifo(step_2 / "train_state.json")
    assert verify_checkpoint(step_2) == "train_state.json is a FIFO (named pipe); a checkpoint holds regular files only"
    (two_steps / "latest").unlink()
    os.mkfifo(two_steps / "latest")
    (two_steps / "step_1" / COMPLETE_MARKER).unlink()
    os.mkfifo(two_steps / "step_1" / COMPLETE_MARKER)
    with pytest.raises(ConfigError, match="no checkpoint in .* verifies and loads"):
        load_newest_verified(two_steps, _load)


def test_a_pickle_in_a_checkpoint_file_is_one_line_and_runs_nothing(tmp_path: Path) -> None:
    """Every torch file of a checkpoint (optimizer, scheduler, RNG state) is read weights-only: a pickle naming code
    is refused in one line (not torch's many-line UnpicklingError), and resume moves on to an older checkpoint."""
    from remat.training_state.data_only import load_weights_only

    marker = tmp_path / "ran"
    file = tmp_path / "optimizer.pt"
    torch.save(_Writes(marker), file)
    with pytest.raises(UnsafeCheckpointError) as info:
        load_weights_only(file)
    assert str(info.value).startswith("optimizer.pt is refused by weights-only loading (")
    assert "\n" not in str(info.value) and not marker.exists()
