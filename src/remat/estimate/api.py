"""``estimate_memory``: the peak memory of a training step, predicted on fake tensors without a GPU.

The settings become a recipe (`remat.estimate.settings.StepSettings.to_recipe`), whose own build and training step
are simulated by `remat.estimate.simulate.simulate_step` on fake tensors, then its allocations are replayed
(`remat.estimate.replay`):

- ``peak_bytes``: the peak of a step after the first (the optimizer state already exists), through PyTorch's CUDA
  caching-allocator rules when ``target="cuda"`` (what ``torch.cuda.max_memory_allocated`` reports), or in exact
  tensor bytes when ``target="cpu"`` (what `remat.memory.LiveTensorTracker` reports for a real CPU step);
- ``tensor_peak_bytes``: the same peak in exact tensor bytes, without the allocator's rounding;
- ``first_step_peak_bytes``: the first step's peak, in which the optimizer state is created;
- ``breakdown`` and ``phase``: the categories of the bytes alive at ``peak_bytes`` and the phase it falls in;
- ``phase_peaks``: the highest ``peak_bytes``-style figure within each phase (forward, loss, backward, optimizer
  step; "start" is the memory held before the step);
- ``host_peak_bytes``: the most host memory that offloaded activations occupy at once during the step (0 without
  an offloading policy; see `remat.estimate.offload`). It is not part of ``peak_bytes``, which is device memory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from remat._child import call_in_child, child_call, needs_fresh_process
from remat._files import read_regular_bytes
from remat.errors import ConfigError
from remat.estimate.replay import replay
from remat.estimate.run import SimulatedRun
from remat.estimate.settings import StepSettings
from remat.estimate.simulate import StepTrace, check_simulable, simulate_step
from remat.hub import hub_config_file, is_hub_id
from remat.models import ModelConfig, get_preset, preset_names
from remat.models.build import ignored_config_keys, resolve_model_config
from remat.models.config import with_concrete_dtype
from remat.recipes.config import RecipeConfig

logger = logging.getLogger(__name__)

ModelLike = ModelConfig | PretrainedConfig | Mapping[str, Any] | str | Path
"""A preset name, a Hub id (``org/name``: its ``config.json`` only, from the HF cache or the Hub), a ``config.json``
(or the directory holding it), a transformers config (object or mapping with ``model_type``), or a
`remat.models.ModelConfig`."""

_SETTING_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(StepSettings) if f.name != "base")


@dataclass(frozen=True)
class MemoryEstimate:
    """The predicted memory of one training step (see the module docstring for what each figure is)."""

    model: str
    settings: StepSettings
    peak_bytes: int
    breakdown: dict[str, int]
    phase: str
    tensor_peak_bytes: int
    first_step_peak_bytes: int
    reserved_bytes: int | None
    parameters: int
    trainable_parameters: int
    phase_peaks: dict[str, int] = field(default_factory=dict)
    attention_kernels: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    seconds: float = 0.0
    label: str = ""
    host_peak_bytes: int = 0

    @property
    def name(self) -> str:
        """The label given by the caller, else a description of the policy and loss."""
        return self.label or self.settings.describe()

    def fits(self, capacity_bytes: int) -> bool:
        """Whether ``peak_bytes`` fits in ``capacity_bytes`` of device memory."""
        return self.peak_bytes <= capacity_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping of every figure and setting (bytes as integers)."""
        return {
            "name": self.name,
            "model": self.model,
            "settings": settings_dict(self.settings),
            "peak_bytes": self.peak_bytes,
            "peak_gib": round(self.peak_bytes / 2**30, 4),
            "peak_gb": round(self.peak_bytes / 1e9, 4),
            "phase": self.phase,
            "breakdown": dict(self.breakdown),
            "phase_peaks": dict(self.phase_peaks),
            "tensor_peak_bytes": self.tensor_peak_bytes,
            "first_step_peak_bytes": self.first_step_peak_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "attention_kernels": dict(self.attention_kernels),
            "notes": list(self.notes),
            "seconds": round(self.seconds, 3),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """``to_dict()`` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    def table(self, *, capacity_bytes: int | None = None) -> str:
        """A plain-text table of the breakdown at the peak (see `remat.estimate.report` for rich output)."""
        from remat.estimate.report import breakdown_table

        return breakdown_table(self, capacity_bytes=capacity_bytes)


@child_call
def estimate_memory(model: ModelLike, settings: StepSettings | None = None, *, label: str = "",
                    **options: Any) -> MemoryEstimate:
    """Predict the peak memory of one training step of ``model`` without allocating it.

    ``settings`` (a `StepSettings`) or keyword ``options`` with the same names choose the step, e.g.
    ``estimate_memory("llama-3.2-1b", batch_size=8, seq_length=2048, autocast="bfloat16", policy="full",
    loss="fused", strategy="fsdp2", world_size=8)``. Raises `ConfigError` for an unknown model or option, a value out
    of range, or a combination the estimate does not model. Called from a process that joined a process group
    (a torchrun worker), a step with FSDP2 or context parallelism is estimated in a child process
    (`remat._child`).
    """
    unknown = sorted(set(options) - set(_SETTING_NAMES))
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a setting of estimate_memory; allowed: {', '.join(_SETTING_NAMES)}")
    settings = dataclasses.replace(settings or StepSettings(), **options)
    settings.validate()
    model_cfg = with_concrete_dtype(resolve_model(model))
    settings = dataclasses.replace(settings, dtype=settings.dtype or model_cfg.dtype,
                                   autocast=settings.autocast or model_cfg.autocast)
    if needs_fresh_process(settings.strategy, settings.cp_size):  # inside a distributed job: `remat._child`
        return call_in_child(estimate_memory, model_cfg, settings, label=label)
    return estimate_recipe(settings.to_recipe(model_cfg), settings, model=model_cfg.describe(), label=label)


def estimate_recipe(recipe: Any, settings: StepSettings, *, model: str, label: str = "") -> MemoryEstimate:
    """The estimate of a validated `remat.recipes.config.RecipeConfig` (what `estimate_memory` runs once the
    keywords are a recipe; the planner prices its candidates with it, each a copy of one recipe with another
    policy). ``settings`` are the same step in keywords, for the report; ``model`` describes the model."""
    return estimate_of_trace(simulate_step(recipe, settings.run()), settings, model=model, label=label)


def estimate_of_trace(trace: StepTrace, settings: StepSettings, *, model: str, label: str = "") -> MemoryEstimate:
    """The estimate a simulated (or composed, `remat.estimate.compose`) step's trace gives."""
    kind = "cuda" if settings.target == "cuda" else "exact"
    steady = replay(trace.events, trace.marks, kind=kind, steady_state=True)
    exact = replay(trace.events, trace.marks, kind="exact", steady_state=True)
    first = replay(trace.events, trace.marks, kind=kind, steady_state=False)
    notes = list(trace.notes)
    if trace.attention_kernels:
        kernels = ", ".join(f"{name} x{count}" for name, count in trace.attention_kernels.items())
        notes.append(f"attention on CUDA: {kernels}")
    return MemoryEstimate(
        model=model,
        settings=settings,
        peak_bytes=steady.peak_bytes,
        breakdown=steady.breakdown,
        phase=steady.phase,
        tensor_peak_bytes=exact.peak_bytes,
        first_step_peak_bytes=first.peak_bytes,
        reserved_bytes=steady.reserved_bytes if kind == "cuda" else None,
        phase_peaks=steady.phase_peaks,
        parameters=trace.parameters,
        trainable_parameters=trace.trainable_parameters,
        attention_kernels=dict(trace.attention_kernels),
        notes=tuple(notes),
        seconds=trace.seconds,
        label=label,
        host_peak_bytes=trace.host_peak,
    )


def resolve_model(model: ModelLike) -> ModelConfig:
    """The `ModelConfig` a model argument names (see `ModelLike`), checked by building its transformers config;
    raises `ConfigError` naming what is wrong."""
    cfg = _model_config(model)
    resolve_model_config(cfg)
    return cfg


def _model_config(model: ModelLike) -> ModelConfig:
    if isinstance(model, ModelConfig):
        return _without_weights(model)
    if isinstance(model, PretrainedConfig):
        return ModelConfig(config=_config_mapping(model.to_dict(), published=True))
    if isinstance(model, Mapping):
        return ModelConfig(config=_config_mapping(model))
    if isinstance(model, (str, Path)):
        text = str(model)
        path = Path(text).expanduser()
        if path.is_dir() and (path / "config.json").is_file():
            path = path / "config.json"
        if path.is_file():
            return _from_config_file(path)
        if "/" in text and not path.exists() and is_hub_id(text):  # org/name: its config.json (HF cache or Hub)
            return _without_weights(ModelConfig(pretrained_model_name_or_path=text))
        return ModelConfig(preset=get_preset(text).name)  # case-insensitive; unknown: the names and close matches
    raise ConfigError(f"model: got {model!r}; allowed: a preset name ({', '.join(preset_names())}), a Hub id "
                      "(org/name), a config.json path or its directory, a transformers config, or a "
                      "remat.models.ModelConfig")


def _without_weights(cfg: ModelConfig) -> ModelConfig:
    """A pretrained model (a directory or a Hub id) is estimated from its config.json: weights are never read."""
    if cfg.quantization is not None:
        raise ConfigError("model.quantization: the estimate does not model 4-bit (bitsandbytes) weights yet; estimate "
                          "the recipe without the section for an upper bound of the same step with the base weights "
                          "in model.dtype")
    if cfg.source != "pretrained":
        return cfg
    source = cfg.pretrained_model_name_or_path or ""
    path = Path(source) / "config.json"
    if not Path(source).is_dir() and is_hub_id(source):  # a Hub id: its config.json alone (HF cache, or download)
        path = Path(hub_config_file(source, "model.pretrained_model_name_or_path"))
    elif not path.is_file():
        raise ConfigError(f"model.pretrained_model_name_or_path: {path.parent} has no config.json")
    data = cfg.model_dump()
    data.pop("pretrained_model_name_or_path")
    data["config"] = _from_config_file(path).config
    return ModelConfig.model_validate(data)


#: The largest config.json read (published ones are a few KiB; multimodal ones tens of KiB).
CONFIG_FILE_LIMIT = 16 << 20


def _from_config_file(path: Path) -> ModelConfig:
    try:
        mapping = json.loads(read_regular_bytes(path, "model: the config", limit=CONFIG_FILE_LIMIT))
    except RecursionError:
        raise ConfigError(f"model: {path} nests deeper than Python's JSON reader goes; allowed: a transformers "
                          "config.json (a flat mapping of fields)") from None
    except (OSError, ValueError) as err:
        raise ConfigError(f"model: cannot read a transformers config from {path}: {err}") from err
    if not isinstance(mapping, dict):
        raise ConfigError(f"model: {path} holds {type(mapping).__name__}, not a config mapping")
    return ModelConfig(config=_config_mapping(mapping, published=True))


def _config_mapping(mapping: Mapping[str, Any], *, published: bool = False) -> dict[str, Any]:
    """A saved config without the keys that are arguments of the loader rather than fields of the config; for a
    ``published`` one (a config.json file, a Hub repository's, a transformers config object) also without the keys
    its config class has no field for, which transformers loads and ignores (`ignored_config_keys`)."""
    out = {k: v for k, v in mapping.items() if k not in ("trust_remote_code", "transformers_version", "_name_or_path")}
    if "model_type" not in out:
        raise ConfigError("model.config.model_type: missing; a transformers config names its model_type "
                          "(e.g. 'llama')")
    if published:
        for key in ignored_config_keys(out):
            del out[key]
    return out


def settings_from_recipe(cfg: Any, **options: Any) -> tuple[ModelConfig, StepSettings]:
    """The model (its config only: weights are never read) and step a `remat.recipes.config.RecipeConfig` trains,
    as keyword settings (the estimate's report and ``--compare`` grids), with ``options`` overriding settings by
    name; the vocabulary is the recipe tokenizer's (the model config's where a Hub model's tokenizer does not load
    here: `remat.data.tokenizer.tokenizer_vocabulary`). A recipe for ``ddp`` / ``fsdp2`` without
    ``distributed.dp_size`` needs ``world_size`` (torchrun decides it at launch)."""
    _say_launcher_decides(cfg, options.get("world_size"))
    cfg = with_concrete_model_dtype(cfg)
    settings = StepSettings.from_recipe(cfg, vocab_size=_recipe_vocabulary(cfg), **options)
    model = _without_weights(cfg.model)
    check_simulable(settings.to_recipe(model), settings.run())
    return model, settings


def recipe_step(cfg: Any, *, target: str, world_size: int | None = None,
                **options: Any) -> tuple[RecipeConfig, SimulatedRun]:
    """The step a recipe trains, as the simulation runs it: the recipe with its model's config in place of its
    weights, and the run (``target``; ``world_size`` for a recipe without ``distributed.dp_size``; the recipe
    tokenizer's vocabulary). Without ``options`` the validated recipe itself is the step; ``options``
    (`remat.estimate.StepSettings` fields overriding the recipe's, a Python caller's keywords) go through
    `settings_from_recipe` and one validation of the recipe they make."""
    if options:
        if world_size:
            options["world_size"] = world_size
        model, settings = settings_from_recipe(cfg, target=target, **options)
        return settings.to_recipe(model), settings.run()
    _say_launcher_decides(cfg, world_size)
    cfg = with_concrete_model_dtype(cfg)
    d = cfg.distributed
    run = SimulatedRun(target=target, vocab_size=_recipe_vocabulary(cfg),  # type: ignore[arg-type]
                       world_size=world_size or (d.dp_size or 1) * d.cp_size * d.tp_size)
    recipe = cfg.model_copy(update={"model": _without_weights(cfg.model)})
    check_simulable(recipe, run)
    return recipe, run


def with_concrete_model_dtype(cfg: Any) -> Any:
    """The recipe with ``model.dtype: auto`` read (`remat.models.config.with_concrete_dtype`)."""
    return cfg.model_copy(update={"model": with_concrete_dtype(cfg.model)}) if cfg.model.dtype == "auto" else cfg


def _recipe_vocabulary(cfg: Any) -> int | None:
    from remat.data.tokenizer import tokenizer_vocabulary

    return tokenizer_vocabulary(cfg.tokenizer, model_path=cfg.model.pretrained_model_name_or_path,
                                trust_remote_code=cfg.model.trust_remote_code)


def _say_launcher_decides(cfg: Any, world_size: int | None) -> None:
    d = cfg.distributed
    if d.strategy != "single" and d.dp_size is None and not world_size:
        shared = d.cp_size * d.tp_size
        layout = ("one rank" if shared == 1 else
                  f"one data-parallel rank: {shared} processes, dp 1"
                  + (f" x cp {d.cp_size}" if d.cp_size > 1 else "") + (f" x tp {d.tp_size}" if d.tp_size > 1 else ""))
        logger.warning("distributed.dp_size is null (the launcher decides it): estimating %s; give world_size "
                       "(--world-size) for the number of processes you will launch", layout)


def settings_dict(settings: StepSettings) -> dict[str, Any]:
    """The settings of an estimate as a JSON-ready mapping (the keyword names of `estimate_memory`)."""
    return _jsonable({name: getattr(settings, name) for name in _SETTING_NAMES})


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
