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
sharded (torch.distributed.checkpoint) variant, `remat.training_state.sharded`, reuses the directory protocol
(its marker says layout "sharded"); `checkpoint_layout` tells the two apart.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from remat.errors import ConfigError
from remat.models.quantization import is_quantized
from remat.training_state.data_only import load_weights_only
from remat.training_state.layout import (
    ADAPTER_DIR,
    LATEST_FILE,
    LAYOUT_SINGLE,
    MODEL_DIR,
    OPTIMIZER_FILE,
    RNG_STATE_FILE,
    SCHEDULER_FILE,
    TRAIN_STATE_FILE,
    atomic_write_text,
    capture_rng_state,
    check_peft_matches,
    check_save_arguments,
    checkpoint_name,
    fsync_tree,
    is_peft_model,
    prune,
    publish,
    quiet_progress_bars,
    read_marker,
    remove_stale_work_dirs,
    resolve_checkpoint,
    restore_rng_state,
    save_hf_model,
    save_tokenizer,
    train_state_json,
    unwrap_model,
    write_marker,
)
from remat.training_state.peft_merge import save_merged_export, whole_state
from remat.training_state.verify import raise_if_unverified

logger = logging.getLogger(__name__)

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
    check_save_arguments(step, keep_last)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_work_dirs(root)
    tmp = root / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write_contents(tmp, step, model, optimizer, lr_scheduler, train_state, tokenizer)
        final = publish(tmp, root / checkpoint_name(step))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(root / LATEST_FILE, final.name + "\n")
    if keep_last is not None:
        prune(root, keep_last, keep=final)
    return final


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Restore weights (the adapter for a peft model), optimizer, scheduler and RNG states; return the train state.

    `path` is a ``step_<N>`` directory, or a checkpoint root (its latest checkpoint is loaded). With `verify` every
    file's SHA-256 is checked against the marker first (ConfigError naming the file when one differs); the resume path
    verifies beforehand (`remat.training_state.verify`) and passes False. The small files are read before
    anything is restored, so a damaged one fails before the model or optimizer is touched.
    """
    path = resolve_checkpoint(Path(path))
    if verify:
        raise_if_unverified(path)
    marker = read_marker(path)
    assert marker is not None  # resolve_checkpoint only returns complete checkpoints
    if marker.get("layout", LAYOUT_SINGLE) != LAYOUT_SINGLE:
        raise ConfigError(
            f"checkpoint {path} is {marker.get('layout')} (torch.distributed.checkpoint, written by an fsdp2 run); "
            "load it with remat.training_state.sharded.load_sharded_checkpoint, or use its model/ export as "
            "model.pretrained_model_name_or_path."
        )
    inner = unwrap_model(model)
    is_peft = is_peft_model(inner)
    check_peft_matches(path, marker, inner)
    train_state = json.loads((path / TRAIN_STATE_FILE).read_text())
    rng_state = load_weights_only(path / RNG_STATE_FILE)
    optimizer_state = _read_state(path / OPTIMIZER_FILE, "optimizer") if optimizer is not None else None
    scheduler_state = _read_state(path / SCHEDULER_FILE, "lr_scheduler") if lr_scheduler is not None else None
    if is_peft:
        _load_adapter(inner, path / ADAPTER_DIR)
    else:
        _load_model_weights(inner, path / MODEL_DIR)
    if optimizer is not None:
        _load_state_into(optimizer, optimizer_state, path / OPTIMIZER_FILE, "optimizer")
    if lr_scheduler is not None:
        _load_state_into(lr_scheduler, scheduler_state, path / SCHEDULER_FILE, "lr_scheduler")
    restore_rng_state(rng_state)
    return train_state


def _write_contents(
    directory: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any | None,
    train_state: dict[str, Any],
    tokenizer: Any | None,
) -> None:
    inner = unwrap_model(model)
    is_peft = is_peft_model(inner)
    if is_peft:
        inner.save_pretrained(directory / ADAPTER_DIR)
        if is_quantized(inner):  # 4-bit base weights: dequantised, merged and written as floats
            save_merged_export(inner, whole_state(inner), directory / MODEL_DIR)
        else:
            save_hf_model(_merged_copy(inner), directory / MODEL_DIR)
    elif isinstance(inner, PreTrainedModel):
        save_hf_model(inner, directory / MODEL_DIR)
    else:
        raise TypeError(f"save_checkpoint needs a transformers or peft model; got {type(inner).__name__}")
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory / MODEL_DIR)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)
    if lr_scheduler is not None:
        torch.save(lr_scheduler.state_dict(), directory / SCHEDULER_FILE)
    (directory / TRAIN_STATE_FILE).write_text(train_state_json(train_state))
    torch.save(capture_rng_state(), directory / RNG_STATE_FILE)
    write_marker(directory, step, peft=is_peft)
    fsync_tree(directory)


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
    with quiet_progress_bars():
        reference = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=dtype,
                                                         trust_remote_code=False)
    try:
        result = model.load_state_dict(reference.state_dict(), strict=False)
    except RuntimeError as err:  # size mismatches: one line, not torch's list of every tensor
        mismatches = [line.strip() for line in str(err).splitlines() if "size mismatch" in line]
        raise ConfigError(
            f"checkpoint weights in {directory} do not fit the model: {len(mismatches)} tensors have another shape "
            f"(e.g. {mismatches[0] if mismatches else err}); build the model from the same config.") from None
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


def _read_state(file: Path, what: str) -> Any:
    if not file.is_file():
        raise ConfigError(f"checkpoint {file.parent} has no {file.name}, so the {what} state cannot be restored.")
    return load_weights_only(file)


def _load_state_into(target: Any, state: Any, file: Path, what: str) -> None:
    try:
        target.load_state_dict(state)
    except (ValueError, KeyError) as err:
        raise ConfigError(f"the {what} state in {file} does not fit the {what} given: {err}") from err


# ------------------------------------------------------------------------------------------------ helpers
