"""Atomic, resumable training checkpoints (single process; DDP writes them from rank 0).

Layout of one checkpoint, ``<root>/step_<N>/``::

    model/              transformers `save_pretrained` output (+ tokenizer): AutoModelForCausalLM loads it;
                        for a peft model, the adapter merged into a copy of the base weights
    adapter/            peft models only: the adapter in peft's format (what resume restores)
    optimizer.pt        optimizer.state_dict()             (if an optimizer was given)
    scheduler.pt        lr_scheduler.state_dict()          (if a scheduler was given)
    train_state.json    the caller's `train_state` (step, epoch, data position, config: JSON types)
    rng_state.pt        torch CPU/CUDA, python `random` and numpy generator states
    COMPLETE.json       written last: format, layout ("single"), step and the size of every file above

Everything is written into ``<root>/.tmp-step_<N>-<pid>/``, flushed to disk, and renamed to ``step_<N>`` in one
step; then ``<root>/latest`` (one line: ``step_<N>``) is replaced atomically and older checkpoints beyond
`keep_last` are removed. A crash at any point leaves `latest` on a complete checkpoint; temporary and
incomplete directories are never picked up. One writer per root is assumed. The helpers are small so that a
sharded (torch.distributed.checkpoint) variant, `remat.recipes.training_state.sharded`, reuses the directory protocol
(its marker says layout "sharded"); `checkpoint_layout` tells the two apart.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from remat.errors import ConfigError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
LATEST_FILE = "latest"
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
_TRASH_PREFIX = ".trash-"


# ------------------------------------------------------------------------------------------------ public API


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after `step` optimizer steps."""
    return f"step_{step}"


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any | None = None,
    train_state: dict[str, Any],
    tokenizer: Any | None = None,
    keep_last: int | None = 2,
) -> Path:
    """Write ``root/step_<step>`` atomically, point ``root/latest`` at it, prune old ones; returns its path.

    `model` is a transformers model or a peft model wrapping one (possibly compiled). `keep_last` is how many
    complete checkpoints to keep, this one included (None keeps all).
    """
    _check_save_arguments(step, keep_last)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_work_dirs(root)
    tmp = root / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write_contents(tmp, step, model, optimizer, lr_scheduler, train_state, tokenizer)
        final = _publish(tmp, root / checkpoint_name(step))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _atomic_write_text(root / LATEST_FILE, final.name + "\n")
    if keep_last is not None:
        _prune(root, keep_last, keep=final)
    return final


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


def is_complete_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a finished checkpoint: its marker parses, names its step, and every file has its size."""
    path = Path(path)
    marker = _read_marker(path)
    if marker is None or marker.get("format") != FORMAT_VERSION:
        return False
    match = _STEP_DIR.match(path.name)
    if match is None or int(match.group(1)) != marker.get("step"):
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for rel, size in files.items():
        file = path / rel
        if not file.is_file() or file.stat().st_size != size:
            return False
    return True


def checkpoint_layout(path: str | os.PathLike[str]) -> str:
    """``"single"`` (this module's format) or ``"sharded"`` (torch.distributed.checkpoint, written by FSDP2 runs) for
    a complete checkpoint directory; ConfigError if `path` is not one."""
    marker = _read_marker(Path(path)) if is_complete_checkpoint(path) else None
    if marker is None:
        raise ConfigError(f"checkpoint path {str(path)!r} is not a complete checkpoint (no valid {COMPLETE_MARKER}).")
    return str(marker.get("layout", LAYOUT_SINGLE))


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any | None = None,
) -> dict[str, Any]:
    """Restore weights (the adapter for a peft model), optimizer, scheduler and RNG states; return the train state.

    `path` is a ``step_<N>`` directory, or a checkpoint root (its latest checkpoint is loaded).
    """
    path = _resolve_checkpoint(Path(path))
    marker = _read_marker(path)
    assert marker is not None  # _resolve_checkpoint only returns complete checkpoints
    if marker.get("layout", LAYOUT_SINGLE) != LAYOUT_SINGLE:
        raise ConfigError(
            f"checkpoint {path} is {marker.get('layout')} (torch.distributed.checkpoint, written by an fsdp2 run); "
            "load it with remat.recipes.training_state.sharded.load_sharded_checkpoint, or use its model/ export as "
            "model.pretrained_model_name_or_path."
        )
    inner = _unwrap(model)
    is_peft = _is_peft_model(inner)
    if is_peft != bool(marker.get("peft")):
        saved = "a peft adapter" if marker.get("peft") else "full model weights"
        given = "a peft model" if is_peft else "a model without peft adapters"
        raise ConfigError(f"checkpoint {path} holds {saved} but {given} was given; build the model the same way.")
    if is_peft:
        _load_adapter(inner, path / ADAPTER_DIR)
    else:
        _load_model_weights(inner, path / MODEL_DIR)
    if optimizer is not None:
        _load_state_into(optimizer, path / OPTIMIZER_FILE, "optimizer")
    if lr_scheduler is not None:
        _load_state_into(lr_scheduler, path / SCHEDULER_FILE, "lr_scheduler")
    restore_rng_state(torch.load(path / RNG_STATE_FILE, map_location="cpu", weights_only=True))
    return json.loads((path / TRAIN_STATE_FILE).read_text())


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


def _check_save_arguments(step: int, keep_last: int | None) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step: must be a non-negative integer; got {step!r}.")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ConfigError(f"keep_last: must be a positive integer or None (keep all); got {keep_last!r}.")


def _write_contents(
    directory: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any | None,
    train_state: dict[str, Any],
    tokenizer: Any | None,
) -> None:
    inner = _unwrap(model)
    is_peft = _is_peft_model(inner)
    if is_peft:
        inner.save_pretrained(directory / ADAPTER_DIR)
        _save_hf_model(_merged_copy(inner), directory / MODEL_DIR)
    elif isinstance(inner, PreTrainedModel):
        _save_hf_model(inner, directory / MODEL_DIR)
    else:
        raise TypeError(f"save_checkpoint needs a transformers or peft model; got {type(inner).__name__}")
    if tokenizer is not None:
        _save_tokenizer(tokenizer, directory / MODEL_DIR)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)
    if lr_scheduler is not None:
        torch.save(lr_scheduler.state_dict(), directory / SCHEDULER_FILE)
    (directory / TRAIN_STATE_FILE).write_text(_to_json(train_state))
    torch.save(capture_rng_state(), directory / RNG_STATE_FILE)
    _write_marker(directory, step, peft=is_peft)
    _fsync_tree(directory)


def _save_hf_model(model: PreTrainedModel, directory: Path, state_dict: dict[str, Any] | None = None) -> None:
    """`save_pretrained` of `model` (with `state_dict` instead of the model's own tensors when given)."""
    with _quiet_progress_bars():
        model.save_pretrained(directory, state_dict=state_dict)
    _enable_cache_in_export(directory / "config.json")


def _enable_cache_in_export(config_file: Path) -> None:
    """Training turns the KV cache off; the exported config turns it back on for inference."""
    config = json.loads(config_file.read_text())
    if config.get("use_cache") is False:
        config["use_cache"] = True
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _merged_copy(peft_model: nn.Module) -> PreTrainedModel:
    """The peft model's adapter merged into a copy of its base model, leaving `peft_model` untouched.

    The copy shares every tensor with the original (new Parameter objects over the same storage), and peft's
    `safe_merge` writes merged weights into new tensors, so only the adapted layers take extra memory.
    """
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(peft_model.parameters(), peft_model.buffers()):
        alias = tensor.detach()
        memo[id(tensor)] = nn.Parameter(alias, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else alias
    twin = copy.deepcopy(peft_model, memo)
    return twin.merge_and_unload(safe_merge=True)


def _save_tokenizer(tokenizer: Any, directory: Path) -> None:
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
        return
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer: expected a transformers or tokenizers tokenizer; got {type(tokenizer).__name__}")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(directory)


def _to_json(train_state: dict[str, Any]) -> str:
    try:
        return json.dumps(train_state, indent=2, sort_keys=True) + "\n"
    except TypeError as err:
        raise TypeError(f"train_state must hold JSON types only (dict, list, str, numbers, bool, None): {err}") from err


def _write_marker(directory: Path, step: int, *, peft: bool, layout: str = LAYOUT_SINGLE,
                  extra: dict[str, Any] | None = None) -> None:
    files = {
        p.relative_to(directory).as_posix(): p.stat().st_size for p in sorted(directory.rglob("*")) if p.is_file()
    }
    marker = {"format": FORMAT_VERSION, "layout": layout, "step": step, "peft": peft, **(extra or {}), "files": files}
    (directory / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _publish(tmp: Path, final: Path) -> Path:
    """Rename the finished temporary directory to its final name (replacing an older save of the same step)."""
    if final.exists():
        trash = final.with_name(f"{_TRASH_PREFIX}{final.name}-{os.getpid()}")
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_path(final.parent)
    return final


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _prune(root: Path, keep_last: int, *, keep: Path) -> None:
    """Delete complete checkpoints beyond `keep_last` (newest steps kept; `keep` always kept and counted)."""
    others = [p for p in list_checkpoints(root) if p != keep]
    for old in others[: max(0, len(others) - (keep_last - 1))]:
        trash = old.with_name(f"{_TRASH_PREFIX}{old.name}-{os.getpid()}")
        os.replace(old, trash)  # a half-deleted checkpoint never keeps its step_<N> name
        shutil.rmtree(trash, ignore_errors=True)


def _remove_stale_work_dirs(root: Path) -> None:
    """Remove leftovers of interrupted saves and deletions by processes that no longer run."""
    for entry in root.iterdir():
        temp = _TEMP_DIR.match(entry.name)
        stale_temp = temp is not None and not _pid_alive(int(temp.group(1)))
        if entry.is_dir() and (stale_temp or entry.name.startswith(_TRASH_PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        _fsync_path(path)
    _fsync_path(directory)


def _fsync_path(path: Path) -> None:
    """Flush a file or directory entry to disk (directories cannot be opened for this on every OS)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------------ reading


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _read_latest_pointer(root: Path) -> str | None:
    try:
        name = (root / LATEST_FILE).read_text().strip()
    except OSError:
        return None
    return name if _STEP_DIR.match(name) else None


def _step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    assert match is not None
    return int(match.group(1))


def _resolve_checkpoint(path: Path) -> Path:
    if is_complete_checkpoint(path):
        return path
    latest = find_latest_checkpoint(path) if path.is_dir() and not _STEP_DIR.match(path.name) else None
    if latest is not None:
        return latest
    raise ConfigError(
        f"checkpoint path {str(path)!r} is not a complete checkpoint (no valid {COMPLETE_MARKER}) nor a directory "
        "holding one; give a step_<N> directory written by save_checkpoint or its parent."
    )


def _load_model_weights(model: nn.Module, directory: Path) -> None:
    """Copy the saved safetensors into `model`, tensor by tensor; fall back to transformers for renamed layouts."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"load_checkpoint needs a transformers or peft model; got {type(model).__name__}")
    files = _safetensors_files(directory)
    targets = model.state_dict(keep_vars=True)
    saved = _saved_shapes(files)
    missing = set(targets) - set(saved) - _tied_names(model)
    if set(saved) - set(targets) or missing:
        # transformers saves some architectures (e.g. fused MoE experts) in their original per-expert layout.
        _load_through_transformers(model, directory)
        return
    wrong = [f"{k} {list(shape)} vs {list(targets[k].shape)}" for k, shape in saved.items()
             if tuple(targets[k].shape) != shape]
    if wrong:
        raise ConfigError(f"checkpoint weights in {directory} do not fit the model (saved vs model shape): "
                          f"{'; '.join(wrong[:3])}; build the model from the same config.")
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    targets[key].copy_(handle.get_tensor(key))


def _load_through_transformers(model: PreTrainedModel, directory: Path) -> None:
    dtype = next(model.parameters()).dtype
    with _quiet_progress_bars():
        reference = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype)
    result = model.load_state_dict(reference.state_dict(), strict=False)
    if result.unexpected_keys or set(result.missing_keys) - _tied_names(model):
        raise ConfigError(
            f"checkpoint weights in {directory} do not fit the model: missing {sorted(result.missing_keys)[:5]}, "
            f"unexpected {sorted(result.unexpected_keys)[:5]}; build the model from the same config."
        )


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / shard for shard in shards]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise ConfigError(f"checkpoint directory {directory} holds no model.safetensors (nor a sharded index).")


def _saved_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    return shapes


def _tied_names(model: nn.Module) -> set[str]:
    """Names of parameters that share their tensor with an earlier-named parameter (saved once)."""
    seen: set[int] = set()
    tied: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    return tied


def _load_adapter(model: nn.Module, directory: Path) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    adapter_name = model.active_adapter
    # peft's save_pretrained writes the "default" adapter at the top and any other adapter in a folder of its name.
    folder = directory if adapter_name == "default" else directory / adapter_name
    weights = load_file(folder / "adapter_model.safetensors")
    expected = set(get_peft_model_state_dict(model, adapter_name=adapter_name))
    if set(weights) != expected:
        raise ConfigError(
            f"adapter in {directory} does not fit the peft model: saved {len(weights)} tensors, the model expects "
            f"{len(expected)} (e.g. missing {sorted(expected - set(weights))[:3]}); apply the same peft config."
        )
    set_peft_model_state_dict(model, weights, adapter_name=adapter_name)


def _load_state_into(target: Any, file: Path, what: str) -> None:
    if not file.is_file():
        raise ConfigError(f"checkpoint {file.parent} has no {file.name}, so the {what} state cannot be restored.")
    try:
        target.load_state_dict(torch.load(file, map_location="cpu", weights_only=True))
    except (ValueError, KeyError) as err:
        raise ConfigError(f"the {what} state in {file} does not fit the {what} given: {err}") from err


# ------------------------------------------------------------------------------------------------ helpers


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Keep transformers' per-shard progress bars out of the training log."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside torch.compile and DistributedDataParallel wrappers."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        else:
            return model


def _is_peft_model(model: nn.Module) -> bool:
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
