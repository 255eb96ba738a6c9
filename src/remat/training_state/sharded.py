"""Sharded training checkpoints with torch.distributed.checkpoint (DCP), for FSDP2 runs.

Layout of one checkpoint, ``<root>/step_<N>/`` (same protocol as `remat.training_state.single`)::

    dcp/                    model and optimizer state, each rank writing its own shards (DCP's format)
    model/                  the whole model in transformers' format (gathered to rank 0): AutoModelForCausalLM loads it;
                            for a peft model, the adapter merged into the base weights
    adapter/                peft models only: the adapter in peft's format (gathered to rank 0)
    scheduler.pt            lr_scheduler.state_dict()            (if a scheduler was given)
    train_state.json        the caller's `train_state`
    rng/rank_<r>.pt         every rank's random generator states
    COMPLETE.json           written last by rank 0: format, layout "sharded", world size, step, file sizes

All ranks write into one temporary directory (its name chosen by rank 0 and broadcast), then rank 0, after a
barrier, writes the marker, renames the directory to ``step_<N>``, points ``latest`` at it and prunes old ones; the
other ranks wait for that. The directory must be on a file system every rank sees.

The state dicts come from ``torch.distributed.checkpoint.state_dict.get_state_dict`` (fully qualified parameter names,
DTensor shards), so a checkpoint loads onto a different number of ranks, or into a single process, as DCP reshards.
A peft model's ``dcp/`` holds its trainable tensors only (the adapters and their optimizer state): the frozen base is
the pretrained checkpoint the run is built from again, as a single-process checkpoint restores the adapter alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.api import CheckpointException
from transformers import PreTrainedModel

from remat.errors import ConfigError
from remat.training_state.layout import (
    ADAPTER_DIR,
    LATEST_FILE,
    LAYOUT_SHARDED,
    MODEL_DIR,
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
from remat.training_state.data_only import (
    DCP_DIR,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    WeightsOnlyLoadPlanner,
    load_weights_only,
)
from remat.training_state.verify import raise_if_unverified

RNG_DIR = "rng"


def save_sharded_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any | None = None,
    train_state: dict[str, Any],
    tokenizer: Any | None = None,
    keep_last: int | None = 2,
    export_model: bool = True,
) -> Path:
    """Write ``root/step_<step>`` from every rank (a collective: all ranks call it); returns its path on every rank.

    `model` is the transformers model whose parameters FSDP2 sharded (not a DDP wrapper). `export_model` also
    gathers the whole model to rank 0 and writes it in transformers' format under ``model/``.
    """
    check_save_arguments(step, keep_last)
    inner = unwrap_model(model)
    peft = is_peft_model(inner)
    root = Path(root)
    tmp = _agree_on_temp_dir(root, step)
    try:
        model_state, optim_state = _state_dicts(inner, optimizer)
        with _single_process_is_intended():
            dcp.save({"model": model_state, **({"optimizer": optim_state} if optimizer is not None else {})},
                     checkpoint_id=tmp / DCP_DIR, no_dist=not dist.is_initialized())
        if export_model:
            export_full_model(inner, tmp / MODEL_DIR, tokenizer=tokenizer)
        _write_rank_files(tmp, lr_scheduler, train_state)
        _barrier()
        final = root / checkpoint_name(step)
        if _rank() == 0:
            write_marker(tmp, step, peft=peft, layout=LAYOUT_SHARDED, extra={"world_size": _world_size()})
            fsync_tree(tmp)
            publish(tmp, final)
            atomic_write_text(root / LATEST_FILE, final.name + "\n")
            if keep_last is not None:
                prune(root, keep_last, keep=final)
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    return final


def load_sharded_checkpoint(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG state from a sharded checkpoint; return the train
    state. Works on any number of ranks (FSDP2), or in one process without a process group (DCP reshards).

    With `verify`, rank 0 checks every file's SHA-256 against the marker first and all ranks stop with the same
    ConfigError when one differs (the resume path verifies beforehand and passes False). The small files are read
    before the model and optimizer are touched."""
    path = resolve_checkpoint(Path(path))
    if verify:
        raise_if_unverified(path, agreed=True)
    marker = read_marker(path)
    assert marker is not None
    if marker.get("layout") != LAYOUT_SHARDED:
        raise ConfigError(f"checkpoint {path} is not sharded (layout {marker.get('layout', 'single')!r}); load it with "
                          "remat.training_state.single.load_checkpoint")
    inner = unwrap_model(model)
    check_peft_matches(path, marker, inner)
    train_state, scheduler_state, rng_state = _agreed(lambda: _small_files(path, lr_scheduler is not None))
    model_state, optim_state = _state_dicts(inner, optimizer)
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    reader = SafeFileSystemReader(path / DCP_DIR)
    try:
        with _single_process_is_intended():
            dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), no_dist=not dist.is_initialized())
    except CheckpointException as err:  # a BaseException: DCP wraps what each rank raised
        raise reader.refusal or _first_failure(err) from None
    except UnsafeCheckpointError:
        raise
    except (RuntimeError, ValueError, KeyError) as err:
        raise ConfigError(f"checkpoint {path} does not fit this model/optimizer: {err}; build them the same way "
                          "as the run that saved it") from err
    options = _options(inner)
    if optimizer is not None:
        set_state_dict(inner, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=options)
    else:
        set_state_dict(inner, (), model_state_dict=state["model"], optim_state_dict={}, options=options)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(scheduler_state)
    restore_rng_state(rng_state)
    return train_state


def _small_files(path: Path, with_scheduler: bool) -> tuple[dict[str, Any], Any, Any]:
    """The train state, the scheduler's state and this rank's generators (each rank reads its own ``rng`` file)."""
    train_state = json.loads((path / TRAIN_STATE_FILE).read_text())
    scheduler_state = load_weights_only(path / SCHEDULER_FILE) if with_scheduler else None
    rng_file = path / RNG_DIR / f"rank_{_rank()}.pt"
    if not rng_file.is_file():  # fewer ranks saved than now load: take rank 0's generators
        rng_file = path / RNG_DIR / "rank_0.pt"
    return train_state, scheduler_state, load_weights_only(rng_file)


def _agreed(read: Any) -> Any:
    """``read()`` on every rank, and its failure, if any rank's read failed, raised on every rank alike.

    # NOTE [ Ranks agree before the collective load ]
    # Each rank reads its own files before ``dcp.load``, a collective. A file damaged on one rank only (its
    # ``rng/rank_<r>.pt``, with a manifest rewritten to match) failed that rank's read while the others entered the
    # collective and waited for it forever: a resume that hung without a word. The outcome of every rank's reads is
    # gathered first, so all ranks raise the same error (the resume then falls back to an older checkpoint on all of
    # them) or all go on together.
    """
    result, failure = None, None
    try:
        result = read()
    except ConfigError as err:
        failure = ("config", _rank(), str(err))
    except Exception as err:  # noqa: BLE001 (a damaged file: agreed below, then raised on every rank)
        failure = ("load", _rank(), f"{type(err).__name__}: {' '.join(str(err).split())[:300]}")
    failures = [failure]
    if dist.is_initialized() and dist.get_world_size() > 1:
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    first = next((f for f in failures if f is not None), None)
    if first is None:
        return result
    kind, rank, message = first
    if kind == "config":
        raise ConfigError(message)
    raise RuntimeError(f"rank {rank} could not read its files of the checkpoint ({message})")


def export_full_model(model: nn.Module, directory: Path, *, tokenizer: Any | None = None) -> None:
    """Gather the whole model (a collective) and write it on rank 0 with ``save_pretrained`` into `directory`; a peft
    model's adapter goes next to it, in ``adapter/``, and ``directory`` holds the adapter merged into the base
    (`remat.training_state.peft_merge`)."""
    inner = unwrap_model(model)
    peft = is_peft_model(inner)
    if not peft and not isinstance(inner, PreTrainedModel):
        raise TypeError(f"export_full_model needs a transformers or peft model; got {type(inner).__name__}")
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(inner, options=options)
    if _rank() != 0:
        return
    if peft:
        from peft import get_peft_model_state_dict

        from remat.training_state.peft_merge import save_merged_export

        with quiet_progress_bars():
            inner.save_pretrained(directory.parent / ADAPTER_DIR,
                                  state_dict=get_peft_model_state_dict(inner, state_dict=full))
        save_merged_export(inner, full, directory)
    else:
        save_hf_model(inner, directory, state_dict=full)
    if tokenizer is not None:
        save_tokenizer(tokenizer, directory)


# ------------------------------------------------------------------------------------------------ helpers


def _first_failure(err: CheckpointException) -> Exception:
    """The error one rank raised inside DCP, as an ordinary exception: an `UnsafeCheckpointError` as it is (the
    checkpoint is damaged: resume moves on to an older one), a mismatch with the model as the ConfigError it is."""
    for failure, _ in err.failures.values():
        if isinstance(failure, (UnsafeCheckpointError, ConfigError)):
            return failure
    failure = next(iter(err.failures.values()))[0] if err.failures else err
    text = " ".join(str(failure).split())[:300]
    if isinstance(failure, (RuntimeError, ValueError, KeyError)) and not isinstance(failure, OSError):
        return ConfigError(f"checkpoint does not fit this model/optimizer: {text}; build them the same way as the run "
                           "that saved it")
    return RuntimeError(f"reading the checkpoint failed with {type(failure).__name__}: {text}")


def _options(model: nn.Module) -> StateDictOptions:
    """A peft model's frozen base is left out of the sharded state (the module docstring); a model's own, kept."""
    if is_peft_model(model):
        return StateDictOptions(ignore_frozen_params=True, strict=False)
    return StateDictOptions()


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], dict[str, Any]]:
    if optimizer is None:
        model_state, optim_state = get_model_state_dict(model, options=_options(model)), {}
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    if is_peft_model(model):  # a frozen weight tied to another (the output head) is not one `ignore_frozen_params` drops
        trainable = {name for name, param in model.named_parameters(remove_duplicate=False) if param.requires_grad}
        model_state = {name: value for name, value in model_state.items() if name in trainable}
    return model_state, optim_state


def _agree_on_temp_dir(root: Path, step: int) -> Path:
    """Rank 0 clears stale work directories and names the temporary directory; every rank gets the same name."""
    names: list[Any] = [None]
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_work_dirs(root)
        tmp = root / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        names[0] = str(tmp)
    if _world_size() > 1:
        dist.broadcast_object_list(names, src=0)
    return Path(names[0])


def _write_rank_files(directory: Path, lr_scheduler: Any | None, train_state: dict[str, Any]) -> None:
    rng_dir = directory / RNG_DIR
    rng_dir.mkdir(exist_ok=True)
    torch.save(capture_rng_state(), rng_dir / f"rank_{_rank()}.pt")
    if _rank() != 0:
        return
    if lr_scheduler is not None:
        torch.save(lr_scheduler.state_dict(), directory / SCHEDULER_FILE)
    (directory / TRAIN_STATE_FILE).write_text(train_state_json(train_state))


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists: here that is what is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()

