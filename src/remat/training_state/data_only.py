"""Reading checkpoints as data: every torch file weights-only, and a sharded (torch.distributed.checkpoint)
checkpoint's ``.metadata`` through an unpickler that admits only the types DCP's metadata is made of, its non-tensor
entries with ``torch.load(weights_only=True)``.

# NOTE [ DCP metadata is a pickle ]
# torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with Python's full unpickler, and its default
# load planner reads every non-tensor entry (an optimizer's lr, betas, ...) with a full ``torch.load`` (weights-only off):
# a ``step_N/`` directory copied or planted into a run's checkpoints would run any code it likes on resume, and the
# hashes in ``COMPLETE.json`` do not help (whoever plants the directory writes the marker too). The metadata of every
# checkpoint DCP writes is built from a dozen dataclasses of ``torch.distributed.checkpoint``, ``torch.Size``, dtypes
# and a path; `_MetadataUnpickler` resolves those names and refuses every other one, so a crafted pickle can
# construct nothing that acts. The tensor shards were already read with ``weights_only=True`` by torch itself.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper, as its default planner uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from remat._files import check_regular_file, read_regular_bytes

#: The folder of a sharded checkpoint that DCP writes, and the metadata file in it.
DCP_DIR = "dcp"
METADATA_FILE = ".metadata"
#: A sanity bound on the metadata of one checkpoint (a 405B model's is a few MiB).
MAX_METADATA_BYTES = 256 * 1024**2

#: The classes (by module) a DCP ``.metadata`` pickle is made of, on the torch versions remat supports.
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice"}),
}


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds something remat never writes (a pickle naming code): the checkpoint is treated as
    damaged, skipped, and resume falls back to an older one."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"{METADATA_FILE} names {module}.{name}, which DCP metadata never holds "
                                    "(refused unread: a pickle that names code could run it)")


def load_weights_only(file: Path) -> Any:
    """``torch.load(file, weights_only=True)`` of a checkpoint file (a regular file, no link); a pickle that names
    anything but tensors and plain containers is an UnsafeCheckpointError in one line, not torch's long
    UnpicklingError."""
    check_regular_file(file, "checkpoint file", follow_symlinks=False)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = " ".join(str(err).split("\n")[0].split())[:200]
        raise UnsafeCheckpointError(f"{file.name} is refused by weights-only loading ({first})") from None


def read_metadata(directory: Path) -> Metadata:
    """The ``Metadata`` of the DCP checkpoint in `directory` (its ``dcp/`` folder), read through the restricted
    unpickler; UnsafeCheckpointError when it is anything else."""
    data = read_regular_bytes(directory / METADATA_FILE, "checkpoint file", limit=MAX_METADATA_BYTES,
                              follow_symlinks=False)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 (any malformed pickle is a damaged checkpoint)
        raise UnsafeCheckpointError(f"{METADATA_FILE} is not DCP metadata ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{METADATA_FILE} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


def metadata_problem(directory: Path) -> str | None:
    """Why the DCP metadata in `directory` cannot be read as data, or None when it can (a check for verification)."""
    try:
        read_metadata(directory)
    except UnsafeCheckpointError as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 (a ConfigError from the file check, or an OSError)
        return str(err)
    return None


class SafeFileSystemReader(FileSystemReader):
    """torch's file-system reader with the metadata read by `read_metadata` (no code can run from it). The first
    refusal is kept in `refusal`: DCP wraps what its reader raises in errors of its own."""

    refusal: UnsafeCheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        directory = Path(str(self.path))
        try:
            if rank is not None:  # rank-local metadata (not written by remat): the same rules
                data = read_regular_bytes(directory / f"__{rank}{METADATA_FILE}", "checkpoint file",
                                          limit=MAX_METADATA_BYTES, follow_symlinks=False)
                metadata = _MetadataUnpickler(io.BytesIO(data)).load()
            else:
                metadata = read_metadata(directory)
        except UnsafeCheckpointError as err:
            self.refusal = self.refusal or err
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor entries read by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(f"entry {read_item.dest_index.fqn} of the checkpoint is refused by "
                                        f"weights-only loading ({' '.join(str(err).split())[:200]})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
