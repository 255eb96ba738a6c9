"""Build a transformers causal LM from a `ModelConfig`: pretrained weights (a local directory or a Hub id), a preset,
or a config mapping.

Weights built from a preset or config are random and come from torch's global RNG on the target device, so
`torch.manual_seed(s)` before `build_model` gives the same weights every time on that device. Models are built for
training: `config.use_cache` is False (a KV cache updated again during activation recompute breaks backward).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import inspect
import logging
import pickle
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.generation import GenerationConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from remat.errors import ConfigError
from remat.hub import hub_load_error, offline_unless_reachable
from remat.models.config import ModelConfig, with_concrete_dtype
from remat.models.presets import get_preset, preset_for_hub_id
from remat.models.quantization import keep_one_layout, packed_weights
from remat.models.shape import check_config_shape, check_buildable

logger = logging.getLogger(__name__)

_PRETRAINED_KEY = "model.pretrained_model_name_or_path"


def resolve_model_config(cfg: ModelConfig, vocab_size: int | None = None) -> PretrainedConfig:
    """The transformers config `build_model` would build (no weights are created or read).

    `vocab_size` is the tokenizer's size (`len(tokenizer)`): it fills the vocabulary of configs that do not fix one
    (and of the small presets), and a model vocabulary smaller than it is an error, except for pretrained models,
    whose embeddings `build_model` grows to fit.
    """
    _check_vocab_argument(vocab_size)
    if cfg.source == "pretrained":
        config = _pretrained_config(cfg)
        if vocab_size is not None and vocab_size > config.vocab_size:
            config.vocab_size = vocab_size
    else:
        config = _config_from_mapping(_config_mapping(cfg, vocab_size), cfg)
        if vocab_size is not None and config.vocab_size < vocab_size:
            raise ConfigError(
                f"model.config.vocab_size: {config.vocab_size} is smaller than the tokenizer's {vocab_size} tokens; "
                f"set it to at least {vocab_size} or leave it out to take the tokenizer's size."
            )
    config.use_cache = False
    return config


def build_model(
    cfg: ModelConfig,
    *,
    vocab_size: int | None = None,
    device: str | torch.device = "cpu",
    meta: bool = False,
    pretrained_kwargs: Mapping[str, Any] | None = None,
) -> PreTrainedModel:
    """Build the causal LM described by `cfg` on `device` (or on the meta device, without storage, if `meta`).

    Parameters are created in `cfg.dtype` (``auto``: `with_concrete_dtype`); the model is returned in train mode with `use_cache=False`.
    See `resolve_model_config` for how `vocab_size` is used. `pretrained_kwargs` go to transformers'
    `from_pretrained` for pretrained sources (for example `revision`, `token`, `cache_dir`, or config overrides).
    """
    _check_vocab_argument(vocab_size)
    cfg = with_concrete_dtype(cfg)
    dtype: torch.dtype = getattr(torch, cfg.dtype)
    if cfg.dequantize and cfg.source != "pretrained":
        logger.info("model.dequantize: the %s's random weights are not quantised; nothing to dequantize", cfg.source)
    if cfg.source == "pretrained" and not meta:
        model = _load_pretrained(cfg, dtype, device, dict(pretrained_kwargs or {}))
        if vocab_size is not None:
            _grow_vocabulary(model, vocab_size)
        model.config.use_cache = False
        return model.train()  # from_pretrained hands models back in eval mode; every source starts the same way
    config = resolve_model_config(cfg, vocab_size)
    if not meta:
        check_buildable(config, dtype.itemsize, device, "model")
    return model_from_config(config, dtype=dtype, attn_implementation=cfg.attn_implementation,
                             trust_remote_code=cfg.trust_remote_code, device=device, meta=meta)


def model_from_config(
    config: PretrainedConfig,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    device: str | torch.device = "cpu",
    meta: bool = False,
) -> PreTrainedModel:
    """A causal LM with random weights for the transformers `config` (from torch's global RNG), built directly on
    `device` (or the meta device), in train mode with `use_cache=False`."""
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(
            f"config: {type(config).__name__} has no causal-LM class in transformers (AutoModelForCausalLM cannot "
            "build it); give a decoder config such as LlamaConfig or Qwen3Config."
        )
    with torch.device("meta" if meta else device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
    model.config.use_cache = False
    return model.train()


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameter elements, tied parameters counted once (works on meta-device models too); a 4-bit
    layer's weight (`remat.models.quantization`) counts the weights it packs, not its bytes."""
    unpacked = packed_weights(model)
    return sum(unpacked.get(id(p), p.numel()) for p in model.parameters() if p.requires_grad or not trainable_only)


def _check_vocab_argument(vocab_size: int | None) -> None:
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
        raise ConfigError(f"vocab_size: must be a positive integer (the tokenizer's size); got {vocab_size!r}.")


def _config_mapping(cfg: ModelConfig, vocab_size: int | None) -> dict[str, Any]:
    """The preset's fields (vocabulary from the tokenizer where the preset takes it) overlaid by `cfg.config`."""
    overrides = copy.deepcopy(cfg.config or {})
    if cfg.preset is None:
        if vocab_size is not None:
            overrides.setdefault("vocab_size", vocab_size)
        return overrides
    preset = get_preset(cfg.preset)
    mapping = copy.deepcopy(dict(preset.config))
    if vocab_size is not None:
        mapping.update({key: vocab_size for key in preset.tokenizer_vocab_keys})
    mapping.update(overrides)
    return mapping


def _config_from_mapping(mapping: dict[str, Any], cfg: ModelConfig) -> PretrainedConfig:
    fields = dict(mapping)
    model_type = fields.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3, cutoff=0.6)
        hint = f" Close matches: {', '.join(close)}." if close else ""
        raise ConfigError(f"model.config.model_type: transformers has no model type {model_type!r}.{hint}")
    config_class = CONFIG_MAPPING[model_type]
    if config_class not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(
            f"model.config.model_type: {model_type!r} has no causal-LM class in transformers "
            "(AutoModelForCausalLM cannot build it); choose a decoder model type such as 'llama' or 'qwen3'."
        )
    derived = _reject_unknown_keys(config_class, model_type, fields)
    check_config_shape(config_class, fields)
    try:
        config = AutoConfig.for_model(model_type, trust_remote_code=cfg.trust_remote_code, **fields)
    except Exception as err:  # transformers raises ValueError, TypeError and huggingface_hub validation errors
        message = " ".join(str(err).split())  # transformers' validation messages span several lines
        raise ConfigError(f"model.config: transformers rejected the {model_type!r} config: {message}") from err
    for key in derived:
        if getattr(config, key, None) != fields[key]:
            raise ConfigError(f"model.config.{key}: {config_class.__name__} ({model_type!r}) derives it from other "
                              f"fields ({getattr(config, key, None)!r} here), so {fields[key]!r} would be ignored; "
                              "drop the key or change the fields it comes from")
    return config


def ignored_config_keys(mapping: Mapping[str, Any]) -> list[str]:
    """The keys of a published config (a config.json its authors wrote, as transformers loads it) that its config
    class has no field for: transformers loads them without a word and nothing reads them. A recipe's own
    ``model.config`` keys are held to `_reject_unknown_keys` instead (a typo there builds the wrong model)."""
    model_type = str(mapping.get("model_type"))
    if model_type not in CONFIG_MAPPING:
        return []
    config_class = CONFIG_MAPPING[model_type]
    known = _known_config_keys(config_class) | _stock_config_keys(config_class)
    return [key for key in mapping if key != "model_type" and key not in known
            and not _mentioned_in_config_code(config_class, key)]


def _reject_unknown_keys(config_class: type[PretrainedConfig], model_type: str, fields: Iterable[str]) -> set[str]:
    """A key transformers does not know would be stored and silently ignored: a typo builds the wrong model. Returns
    the keys known only from the stock config's own ``to_dict()`` (derived from other fields, e.g. deepseek's
    ``qk_head_dim``): accepted when the built config agrees with them (a saved config.json carries them)."""
    known = _known_config_keys(config_class)
    derived = set()
    for key in fields:
        if key in known or _mentioned_in_config_code(config_class, key):
            continue
        if key in _stock_config_keys(config_class):
            derived.add(key)
            continue
        close = difflib.get_close_matches(key, sorted(known | _stock_config_keys(config_class)), n=1, cutoff=0.7)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"model.config.{key}: {config_class.__name__} ({model_type!r}) has no such field, so transformers "
            f"would ignore it.{hint}"
        )
    return derived


@functools.cache
def _known_config_keys(config_class: type[PretrainedConfig]) -> frozenset[str]:
    names: set[str] = set(config_class.attribute_map) | set(getattr(config_class, "sub_configs", {}) or {})
    if dataclasses.is_dataclass(config_class):
        names |= {f.name for f in dataclasses.fields(config_class)}
    names |= set(GenerationConfig._get_default_generation_params())  # accepted and moved to the generation config
    return frozenset(names)


@functools.cache
def _stock_config_keys(config_class: type[PretrainedConfig]) -> frozenset[str]:
    """The keys the class's default config writes (``to_dict()``), derived fields included."""
    try:
        return frozenset(config_class().to_dict())
    except Exception:  # a config class that cannot be built with no arguments has no stock keys to offer
        return frozenset()


@functools.cache
def _config_code(config_class: type[PretrainedConfig]) -> str:
    """Source of the modules defining the config class and its bases (legacy keys are read from `kwargs` there)."""
    modules = {cls.__module__ for cls in config_class.__mro__ if cls.__module__.startswith("transformers")}
    return "\n".join(inspect.getsource(sys.modules[name]) for name in sorted(modules))


def _mentioned_in_config_code(config_class: type[PretrainedConfig], key: str) -> bool:
    code = _config_code(config_class)
    return f'"{key}"' in code or f"'{key}'" in code


def _pretrained_source(cfg: ModelConfig) -> tuple[str, bool]:
    """(the path or Hub id to load, whether it is a local directory)."""
    path = cfg.pretrained_model_name_or_path
    assert path is not None
    if not Path(path).is_dir():
        return path, False  # ModelConfig accepted it as a Hub id
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(
            f"{_PRETRAINED_KEY}: {path!r} has no config.json; give a directory written by `save_pretrained` "
            "(config.json next to the weights)."
        )
    return path, True


def _pretrained_config(cfg: ModelConfig) -> PretrainedConfig:
    path, local = _pretrained_source(cfg)
    if not local:
        offline_unless_reachable()
    try:
        return AutoConfig.from_pretrained(path, local_files_only=local, trust_remote_code=cfg.trust_remote_code)
    except Exception as err:  # OSError, ValueError, huggingface_hub's field validation of a malformed config.json
        raise _load_error(path, local, "read a transformers config", err) from err


def _load_pretrained(
    cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, kwargs: dict[str, Any]
) -> PreTrainedModel:
    path, local = _pretrained_source(cfg)
    if not local:
        offline_unless_reachable()
    kwargs.setdefault("local_files_only", local)
    if "config" not in kwargs:
        config = _pretrained_config(cfg)
        if local:  # checked before any weight is read: shape numbers, size, weight dtypes
            check_config_shape(type(config), config.to_dict(), prefix=f"{path}/config.json")
            check_buildable(config, dtype.itemsize, device, _PRETRAINED_KEY)
            if getattr(config, "quantization_config", None) is None:  # a quantised one: `_dequantizing`
                _refuse_integer_weights(Path(path))
        kwargs["config"] = config
    if cfg.quantization is not None and "quantization_config" not in kwargs:  # QLoRA: remat.models.quantization
        kwargs["quantization_config"] = cfg.quantization.bitsandbytes_config(dtype)
        kwargs.setdefault("device_map", {"": torch.device(device)})  # quantised on the device it loads to
    if "quantization_config" not in kwargs:  # one the caller passes (a QLoRA BitsAndBytesConfig, say) is theirs
        kwargs.update(_dequantizing(cfg, kwargs["config"], path, dtype))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=cfg.attn_implementation, trust_remote_code=cfg.trust_remote_code,
            **kwargs,
        )
    except (OSError, ValueError, SafetensorError) as err:  # SafetensorError: a truncated or corrupt weights file
        raise _load_error(path, local, "load a causal LM", err) from err
    except RuntimeError as err:  # weights whose shapes do not match the config ("... ignore_mismatched_sizes")
        raise _load_error(path, local, "load a causal LM (its weights do not fit its config.json)", err) from err
    except pickle.UnpicklingError as err:  # a pickled .bin that needs more than weights-only loading allows
        raise ConfigError(f"{_PRETRAINED_KEY}: {path!r} holds a pickled weights file (pytorch_model.bin) that "
                          "names more than tensors, which torch.load would run as code; remat loads weights only "
                          "(weights_only=True refused it): convert the weights to safetensors where you trust them "
                          "(save_pretrained writes model.safetensors)") from err
    if "quantization_config" in kwargs:
        keep_one_layout(model)
    return model if "device_map" in kwargs else model.to(device)


# NOTE [ Quantised checkpoints ]
# Some checkpoints are published quantised (DeepSeek's FP8 blocks, gpt-oss's MXFP4 experts): their config.json has a
# `quantization_config`, and transformers would load them as quantised layers (or, without a GPU, dequantise FP8 with
# a warning), which remat does not train. `model.dequantize: true` (NeMo's `checkpoint.dequantize_base_checkpoint`)
# asks transformers' own quantizer to dequantise every weight to `model.dtype` as it loads (its `dequantize` flag, set
# on the checkpoint's own quantization settings), so the model trains like any float checkpoint and saves without a
# `quantization_config`. A quantised checkpoint without the key, or one whose method transformers cannot dequantise,
# is refused before any weight is read; the key on a float checkpoint is said and does nothing.
def _dequantizing(cfg: ModelConfig, config: PretrainedConfig, path: str, dtype: torch.dtype) -> dict[str, Any]:
    """The `from_pretrained` arguments that load ``path``'s quantised weights dequantised (see the NOTE)."""
    from transformers.quantizers.auto import AutoQuantizationConfig

    raw = getattr(config, "quantization_config", None)
    if raw is None:
        if cfg.dequantize:
            logger.info("model.dequantize: %s is not quantised; its weights load as they are", path)
        return {}
    settings = dict(raw) if isinstance(raw, Mapping) else raw.to_dict()
    method = settings.get("quant_method") or ("bitsandbytes" if settings.get("load_in_4bit")
                                              or settings.get("load_in_8bit") else "unknown")
    if not cfg.dequantize:
        raise ConfigError(f"{_PRETRAINED_KEY}: {path!r} is a quantised checkpoint ({method}); remat trains "
                          "floating-point weights: set model.dequantize: true to load it dequantised to model.dtype, "
                          "or give a float checkpoint")
    try:
        quantization = AutoQuantizationConfig.from_dict(settings)
    except (ValueError, TypeError, ImportError) as err:
        raise ConfigError(f"model.dequantize: cannot read {path!r}'s quantization_config ({method}): "
                          f"{' '.join(str(err).split())[:300]}") from None
    if not hasattr(quantization, "dequantize"):
        raise ConfigError(f"model.dequantize: {path!r} is quantised with {method}, which transformers cannot "
                          "dequantise as it loads; allowed: fp8, mxfp4, compressed-tensors or gguf checkpoints, or "
                          "a float checkpoint")
    quantization.dequantize = True
    logger.info("model.dequantize: %s is quantised (%s); its weights are dequantised to %s as they load", path, method,
                str(dtype).removeprefix("torch."))
    return {"quantization_config": quantization}


def _refuse_integer_weights(directory: Path) -> None:
    """A weights file holding integer tensors (int8 quantised, say) would be cast to float silently and train as
    nonsense: ConfigError naming the file and a tensor. Only the headers of the safetensors files are read."""
    from safetensors import safe_open

    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as weights:
                for name in weights.keys():  # noqa: SIM118 (safe_open has no iterator)
                    if not name.endswith("weight"):  # integer buffers (position ids, masks) are fine
                        continue
                    kind = weights.get_slice(name).get_dtype()
                    if kind.startswith(("I", "U")) or kind == "BOOL":
                        raise ConfigError(
                            f"{_PRETRAINED_KEY}: {file} holds {kind} weights ({name}); remat trains floating-point "
                            "weights and would cast these silently: give a float checkpoint (F32, BF16 or F16), "
                            "not a quantised one")
        except SafetensorError as err:
            raise _load_error(str(directory), True, "load a causal LM", err) from err


def _load_error(path: str, local: bool, action: str, err: Exception) -> ConfigError:
    """One line saying what could not be loaded from where; for a Hub id, what to do about it."""
    if not local:
        matching = preset_for_hub_id(path)
        hint = f"; for random weights of the same shape use `model.preset: {matching.name}`" if matching else ""
        return hub_load_error(_PRETRAINED_KEY, path, action, err, hint)
    reason = " ".join(str(err).split())  # transformers' messages span several lines
    return ConfigError(f"{_PRETRAINED_KEY}: cannot {action} from {path!r}: {reason}")


def _grow_vocabulary(model: PreTrainedModel, vocab_size: int) -> None:
    current = model.get_input_embeddings().num_embeddings
    if vocab_size <= current:
        return
    logger.warning(
        "The tokenizer has %d tokens but the pretrained model only %d embeddings: resizing the embeddings "
        "(new rows are initialised from the mean of the old ones).",
        vocab_size,
        current,
    )
    model.resize_token_embeddings(vocab_size)
