"""The directory protocol shared by both kinds of saved training state (`remat.training_state.single` and
`.sharded`): the ``step_<N>`` layout and its file names, the ``COMPLETE.json`` marker, atomic publishing through a
temporary directory and the ``latest`` pointer, pruning, the RNG state, and the parts of a step directory both write
(the exported transformers model, the tokenizer, the train state JSON).

Layout of one checkpoint, ``<root>/step_<N>/``: see `remat.training_state.single`. Everything is written
into ``<root>/.tmp-step_<N>-<pid>/``, flushed to disk, and renamed to ``step_<N>`` in one step; then ``<root>/latest``
(one line: ``step_<N>``) is replaced atomically and older checkpoints beyond ``keep_last`` are removed. A crash at any
point leaves ``latest`` on a complete checkpoint; temporary and incomplete directories are never picked up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging as hf_logging

from remat._files import fsync_path, kind_of, printable, read_regular_bytes, write_atomic
from remat.errors import ConfigError
from remat.training_state.digest import HASH_ALGORITHM, digests
from remat.training_state.names import LATEST_FILE

logger = logging.getLogger(__name__)

# Format 2 records each file's size and SHA-256 (`remat.training_state.verify` checks them on resume); format 1
# (sizes only, written before content hashes existed) is still read, as unverified. The version was bumped rather
# than an optional key added so that a format-2 marker missing a file's hash is broken, not silently unverified.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
COMPLETE_MARKER = "COMPLETE.json"
MODEL_DIR = "model"
ADAPTER_DIR = "adapter"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
TRAIN_STATE_FILE = "train_state.json"
RNG_STATE_FILE = "rng_state.pt"
LAYOUT_SINGLE = "single"
LAYOUT_SHARDED = "sharded"

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TEMP_DIR = re.compile(r"^\.tmp-step_\d+-(\d+)$")
_TEMP_FILE = re.compile(r"^\..+\.tmp-(\d+)$")  # atomic_write_text's `.<name>.tmp-<pid>`
_TRASH_PREFIX = ".trash-"


# ------------------------------------------------------------------------------------------------ public API


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after `step` optimizer steps."""
    return f"step_{step}"


def find_latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint `root/latest` names if it is complete, else the complete one with the highest step, else None."""
    root = Path(root)
    if not root.is_dir():
        return None
    named = _read_latest_pointer(root)
    if named is not None and is_complete_checkpoint(root / named):
        return root / named
    complete = list_checkpoints(root)
    if not complete:
        return None
    if named is not None:
        logger.warning("%s names %r, which is missing or incomplete; using %s", root / LATEST_FILE, named,
                       complete[-1].name)
    return complete[-1]


def list_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints under `root`, oldest step first (temporary and incomplete directories left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and is_complete_checkpoint(p)]
    return sorted(found, key=_step_of)


def step_directories(root: Path) -> list[Path]:
    """Every ``step_<N>`` directory under `root`, complete or not, oldest step first ([] if `root` is no directory)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir()), key=_step_of)


def is_step_name(name: str) -> bool:
    """Whether `name` is a checkpoint directory's name, ``step_<N>``."""
    return _STEP_DIR.match(name) is not None


def is_complete_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a finished checkpoint: its marker parses, names its step, and every file has its size
    (contents are not hashed here: `remat.training_state.verify.verify_checkpoint` does that)."""
    return incomplete_reason(Path(path)) is None


def incomplete_reason(path: Path) -> str | None:
    """Why `path` is not a finished checkpoint (marker, step or a file's size), or None when it is one."""
    marker = read_marker(path)
    if marker is None:
        return f"no readable {COMPLETE_MARKER}"
    if marker.get("format") not in READABLE_FORMATS:
        return f"{COMPLETE_MARKER} has format {marker.get('format')!r}, this remat reads {list(READABLE_FORMATS)}"
    match = _STEP_DIR.match(path.name)
    if match is None or int(match.group(1)) != marker.get("step"):
        return f"{COMPLETE_MARKER} names step {marker.get('step')!r}, not the directory's"
    records = marker_records(marker)
    if not records:
        return f"{COMPLETE_MARKER} lists no files"
    outside = next((rel for rel in records if not _inside(rel)), None)
    if outside is not None:
        return f"{COMPLETE_MARKER} names {printable(outside, 80)!r}, a path outside the checkpoint (refused unread)"
    if path.is_symlink():
        return "the checkpoint directory is a symbolic link: its files lie outside the checkpoint (refused unread)"
    root = path.resolve()
    for rel, (size, _) in records.items():
        file = path / rel
        linked = next((part for part in _folders_on_the_way(path, rel) if part.is_symlink()), None)
        if linked is not None:
            return (f"{rel} lies outside the checkpoint, behind the symbolic link {linked.relative_to(path)} (a "
                    "checkpoint holds no links; refused unread)")
        try:
            info = file.lstat()
        except OSError:
            return f"{rel} is missing"
        if not stat.S_ISREG(info.st_mode):
            return f"{rel} is {kind_of(info.st_mode)}; a checkpoint holds regular files only"
        if not file.resolve().is_relative_to(root):  # a linked folder on the way
            return f"{rel} lies outside the checkpoint (through a symbolic link; refused unread)"
        if info.st_size != size:
            return f"{rel} has {info.st_size} bytes, {COMPLETE_MARKER} says {size}"
    return None


def _folders_on_the_way(path: Path, rel: str) -> list[Path]:
    """The folders between a checkpoint directory and one of its files (``model`` for ``model/config.json``)."""
    parts = rel.split("/")[:-1]
    return [path.joinpath(*parts[:i + 1]) for i in range(len(parts))]


def _inside(rel: Any) -> bool:
    """Whether a marker's file name stays inside its checkpoint: relative, '/'-separated, no '..', no empty part."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\x00" in rel:
        return False
    parts = rel.split("/")
    return not rel.startswith("/") and all(part not in ("", ".", "..") for part in parts)


def marker_records(marker: dict[str, Any]) -> dict[str, tuple[int, str | None]] | None:
    """``{relative path: (size, hex digest or None)}`` from a marker (format 1 has no digests); None if malformed."""
    files = marker.get("files")
    if not isinstance(files, dict):
        return None
    records: dict[str, tuple[int, str | None]] = {}
    for rel, entry in files.items():
        if marker.get("format") == 1 and isinstance(entry, int):
            records[rel] = (entry, None)
        elif isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(
                entry.get(HASH_ALGORITHM), str):
            records[rel] = (entry["size"], entry[HASH_ALGORITHM])
        else:
            return None
    return records


def checkpoint_layout(path: str | os.PathLike[str]) -> str:
    """``"single"`` (this module's format) or ``"sharded"`` (torch.distributed.checkpoint, written by FSDP2 runs) for
    a complete checkpoint directory; ConfigError if `path` is not one."""
    marker = read_marker(Path(path)) if is_complete_checkpoint(path) else None
    if marker is None:
        raise ConfigError(f"checkpoint path {str(path)!r} is not a complete checkpoint (no valid {COMPLETE_MARKER}).")
    return str(marker.get("layout", LAYOUT_SINGLE))


def capture_rng_state() -> dict[str, Any]:
    """The state of every random generator a training step may draw from (torch CPU and CUDA, random, numpy)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(cached))
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back the generator states captured by `capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            logger.warning("checkpoint has CUDA RNG states for %d devices, this process sees %d: not restored",
                           len(state["cuda"]), torch.cuda.device_count())
    np = _numpy()
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


# ------------------------------------------------------------------------------------------------ writing


def check_save_arguments(step: int, keep_last: int | None) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step: must be a non-negative integer; got {step!r}.")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"keep_last: must be a positive integer or None (keep all); got {keep_last!r}.")


def save_hf_model(model: PreTrainedModel, directory: Path, state_dict: dict[str, Any] | None = None) -> None:
    """`save_pretrained` of `model` (with `state_dict` instead of the model's own tensors when given)."""
    with quiet_progress_bars():
        model.save_pretrained(directory, state_dict=state_dict)
    _enable_cache_in_export(directory / "config.json")


def _enable_cache_in_export(config_file: Path) -> None:
    """Training turns the KV cache off; the exported config turns it back on for inference."""
    config = json.loads(config_file.read_text())
    if config.get("use_cache") is False:
        config["use_cache"] = True
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
        return
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer: expected a transformers or tokenizers tokenizer; got {type(tokenizer).__name__}")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(directory)


def train_state_json(train_state: dict[str, Any]) -> str:
    try:
        return json.dumps(train_state, indent=2, sort_keys=True) + "\n"
    except TypeError as err:
        raise TypeError(f"train_state must hold JSON types only (dict, list, str, numbers, bool, None): {err}") from err


def write_marker(directory: Path, step: int, *, peft: bool, layout: str = LAYOUT_SINGLE,
                  extra: dict[str, Any] | None = None) -> None:
    """Write ``COMPLETE.json``: format, layout, step and every file's size and SHA-256 (hashed here, streamed)."""
    paths = [p for p in sorted(directory.rglob("*")) if p.is_file() and p.name != COMPLETE_MARKER]
    files = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, HASH_ALGORITHM: digest}
             for p, digest in zip(paths, digests(paths), strict=True)}
    marker = {"format": FORMAT_VERSION, "layout": layout, "step": step, "peft": peft, **(extra or {}), "files": files}
    (directory / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def publish(tmp: Path, final: Path) -> Path:
    """Rename the finished temporary directory to its final name (replacing an older save of the same step)."""
    if final.exists():
        trash = final.with_name(f"{_TRASH_PREFIX}{final.name}-{os.getpid()}")
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_path(final.parent)
    return final


def atomic_write_text(path: Path, text: str) -> None:
    """`remat._files.write_atomic`: replaced in one step, never through a planted link."""
    write_atomic(path, text, "checkpoint file")


def prune(root: Path, keep_last: int, *, keep: Path) -> None:
    """Delete complete checkpoints beyond `keep_last` (newest steps kept; `keep` always kept and counted). Only the
    line that leads to `keep` counts: steps after it (not this run's) and ``archive/`` are never touched.

    `keep` is the checkpoint just written, hashed as it was written, so it is the newest one that verifies; when it
    is not complete (its marker or a file missing) nothing is deleted."""
    if not is_complete_checkpoint(keep):
        logger.warning("not pruning %s: %s is not a complete checkpoint", root, keep)
        return
    others = [p for p in list_checkpoints(root) if _step_of(p) < _step_of(keep)]
    for old in others[: max(0, len(others) - (keep_last - 1))]:
        trash = old.with_name(f"{_TRASH_PREFIX}{old.name}-{os.getpid()}")
        os.replace(old, trash)  # a half-deleted checkpoint never keeps its step_<N> name
        shutil.rmtree(trash, ignore_errors=True)


def remove_stale_work_dirs(root: Path) -> None:
    """Remove leftovers of interrupted saves and deletions by processes that no longer run (temporary step
    directories, ``.trash-*`` directories and ``.latest.tmp-<pid>`` files)."""
    for entry in root.iterdir():
        temp = _TEMP_DIR.match(entry.name)
        stale_temp = temp is not None and not _pid_alive(int(temp.group(1)))
        if entry.is_dir() and (stale_temp or entry.name.startswith(_TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)
        temp_file = _TEMP_FILE.match(entry.name)
        if temp_file is not None and entry.is_file() and not _pid_alive(int(temp_file.group(1))):
            entry.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True


def fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        fsync_path(path)
    fsync_path(directory)


# ------------------------------------------------------------------------------------------------ reading


#: A marker lists a few hundred files at most (a sharded save: a few per rank); far more is not one remat wrote.
MAX_MARKER_BYTES = 64 * 1024**2


def read_marker(path: Path) -> dict[str, Any] | None:
    """The parsed ``COMPLETE.json`` of `path`, or None when it is missing, not a regular file (a FIFO never
    blocks), too large, or not a JSON object."""
    try:
        marker = json.loads(read_regular_bytes(path / COMPLETE_MARKER, "checkpoint marker", limit=MAX_MARKER_BYTES,
                                               follow_symlinks=False))
    except (ConfigError, OSError, ValueError, RecursionError):
        return None
    return marker if isinstance(marker, dict) else None


def read_pointer(root: Path) -> str:
    """The text of ``root/latest`` (a regular file, a few bytes); ConfigError or ValueError when it is not one."""
    return read_regular_bytes(root / LATEST_FILE, "checkpoint pointer", limit=4096,
                              follow_symlinks=False).decode("utf-8").strip()


def _read_latest_pointer(root: Path) -> str | None:
    try:
        name = read_pointer(root)
    except (ConfigError, OSError, ValueError):  # ValueError: bytes that are not text
        return None
    return name if _STEP_DIR.match(name) else None


def _step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    assert match is not None
    return int(match.group(1))


def resolve_checkpoint(path: Path) -> Path:
    if is_complete_checkpoint(path):
        return path
    latest = find_latest_checkpoint(path) if path.is_dir() and not _STEP_DIR.match(path.name) else None
    if latest is not None:
        return latest
    raise ConfigError(
        f"checkpoint path {str(path)!r} is not a complete checkpoint (no valid {COMPLETE_MARKER}) nor a directory "
        "holding one; give a step_<N> directory written by save_checkpoint or its parent."
    )


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Keep transformers' per-shard progress bars out of the training log."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside torch.compile and DistributedDataParallel wrappers."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def check_peft_matches(path: Path, marker: dict[str, Any], model: nn.Module) -> None:
    """ConfigError when the checkpoint's marker says adapters and ``model`` has none, or the other way round."""
    if is_peft_model(model) != bool(marker.get("peft")):
        saved = "a peft adapter" if marker.get("peft") else "full model weights"
        given = "a peft model" if is_peft_model(model) else "a model without peft adapters"
        raise ConfigError(f"checkpoint {path} holds {saved} but {given} was given; build the model the same way.")


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
