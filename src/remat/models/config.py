"""The `model` section of a recipe: where the model comes from and how its parameters are stored."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import ConfigDict, field_validator, model_validator

from remat._files import read_regular_bytes
from remat.config_base import StrictModel
from remat.errors import ConfigError
from remat.hub import hub_config_file, is_hub_id
from remat.models.embedding_repair import EmbeddingRowRepair
from remat.models.presets import get_preset, preset_names
from remat.models.quantization import QuantizationConfig

logger = logging.getLogger(__name__)

ParamDtype = Literal["float32", "bfloat16", "float16"]
ModelDtype = Literal["float32", "bfloat16", "float16", "auto"]
"""``model.dtype``: a `ParamDtype`, or ``auto`` (the checkpoint's, `with_concrete_dtype`)."""
AutocastDtype = Literal["bfloat16", "float16"]
DocumentAttention = Literal["auto", True, False]
ModelSource = Literal["pretrained", "preset", "config"]

def check_document_attention(value: Any, key: str = "model.document_attention") -> DocumentAttention:
    """``value`` as a document-attention setting (auto, true or false), or a `ConfigError` naming ``key``."""
    if value is True or value is False or value == "auto":
        return value  # type: ignore[no-any-return]
    raise ConfigError(f"{key}: must be auto, true or false; got {value!r}")


class ModelConfig(StrictModel):
    """Which causal LM to train: pretrained weights (a local directory or a Hub id), a named shape preset, or a
    transformers config.

    Exactly one source is given; `config` may accompany `preset` to override some of its fields (for example
    `num_hidden_layers`). A Hub id is resolved by transformers as `from_pretrained` resolves it: downloaded into
    the Hugging Face cache when online, read from that cache when offline (`HF_HUB_OFFLINE=1`).
    """

    # a config's non-finite values (mamba2's time_step_limit [0.0, inf]) stay floats in mode="json" dumps, not null
    model_config = ConfigDict(**StrictModel.model_config, ser_json_inf_nan="constants")

    pretrained_model_name_or_path: str | None = None
    """A local directory holding `config.json` and weights (as written by `save_pretrained`), or a Hub id such as
    `meta-llama/Llama-3.2-1B` (an existing directory of that name wins)."""
    preset: str | None = None
    """A shape preset name (see `remat.models.preset_names()`): random weights of a well-known model's shape."""
    config: dict[str, Any] | None = None
    """A transformers config as a mapping, `model_type` included; with `preset`, fields that override it."""
    dtype: ModelDtype = "float32"
    """The dtype of the parameters; ``auto`` (transformers' ``dtype="auto"``): the one the pretrained checkpoint's
    config.json names, or ``config``'s own ``dtype`` / ``torch_dtype``, float32 where none is named; read when the
    model is first needed (`with_concrete_dtype`), so a recipe validates without the checkpoint."""
    autocast: AutocastDtype | None = None
    """Run forward/backward under `torch.autocast` in this dtype (the training loop applies it)."""
    attn_implementation: Literal["sdpa", "eager"] | None = None
    """Attention kernel; None keeps the transformers default for the architecture."""
    document_attention: DocumentAttention = "auto"
    """Packed rows attend per document with no dense [tokens, tokens] mask (`remat.models.document_attention`):
    auto (on when dataset.packing is true and the attention is sdpa or eager), true (on, or an error for another
    attention implementation) or false (transformers builds its block-diagonal mask)."""
    output_hidden_states: bool = False
    """The loss needs the last hidden states instead of logits (fused linear cross-entropy)."""
    trust_remote_code: bool = False
    """Allow custom modelling code shipped with the pretrained model (a local directory or a Hub repository)."""
    embedding_row_repair: EmbeddingRowRepair | None = None
    """Repair the pretrained input-embedding rows left at (near) zero from the output embeddings
    (`remat.models.embedding_repair`); null: load the weights as they are."""
    quantization: QuantizationConfig | None = None
    """Quantise the pretrained base weights to 4 bits as they load and train LoRA adapters over them (QLoRA,
    bitsandbytes: `remat.models.quantization`); needs ``pretrained_model_name_or_path`` and a ``peft`` section."""
    dequantize: bool = False
    """Load a quantised pretrained checkpoint (FP8, MXFP4: its config.json has a ``quantization_config``) dequantised
    to `dtype` by transformers' own quantizer; without it such a checkpoint is refused. Nothing to do for float
    weights (said once)."""

    @field_validator("pretrained_model_name_or_path")
    @classmethod
    def _local_directory_or_hub_id(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser()
        if path.is_dir():
            return str(path)
        if path.exists():
            raise ConfigError(
                f"model.pretrained_model_name_or_path: {value!r} is a file; give the directory that holds "
                "config.json and the weights, or a Hub id such as 'meta-llama/Llama-3.2-1B'."
            )
        if not is_hub_id(value):
            raise ConfigError(
                f"model.pretrained_model_name_or_path: {value!r} is neither a local directory nor a Hub id; allowed: "
                "a directory written by `save_pretrained`, or a Hub id 'org/name' (letters, digits, '-', '_', '.')."
            )
        return value

    @field_validator("document_attention", mode="before")
    @classmethod
    def _auto_true_or_false(cls, value: Any) -> Any:
        return check_document_attention(value)

    @field_validator("preset")
    @classmethod
    def _must_be_known_preset(cls, value: str | None) -> str | None:
        return None if value is None else get_preset(value).name

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelConfig:
        if self.quantization is not None and self.pretrained_model_name_or_path is None:
            raise ConfigError("model.quantization: quantises pretrained weights as they load; model.preset and "
                              "model.config build random weights; allowed with model.pretrained_model_name_or_path")
        if self.quantization is not None and self.dequantize:
            raise ConfigError("model.quantization with model.dequantize: true; the one quantises the base weights as "
                              "they load, the other loads a quantised checkpoint as floats; allowed: one of them")
        if self.pretrained_model_name_or_path is not None:
            if self.preset is not None or self.config is not None:
                other = "model.preset" if self.preset is not None else "model.config"
                raise ConfigError(
                    f"model.pretrained_model_name_or_path and {other} are both given; choose one source "
                    "(a pretrained directory is built from its own config.json)."
                )
            return self
        if self.preset is None and self.config is None:
            raise ConfigError(
                "model: no model source given. Set one of model.pretrained_model_name_or_path (a local directory or "
                f"a Hub id), model.preset (one of: {', '.join(preset_names())}) or model.config (a transformers config "
                "mapping with model_type)."
            )
        if self.config is not None:
            self._check_model_type(self.config.get("model_type"))
        return self

    def _check_model_type(self, model_type: Any) -> None:
        if self.preset is None:
            if not isinstance(model_type, str) or not model_type:
                raise ConfigError(
                    f"model.config.model_type: must be a transformers model type such as 'llama' or 'qwen3'; "
                    f"got {model_type!r}."
                )
            return
        preset_type = get_preset(self.preset).model_type
        if model_type is not None and model_type != preset_type:
            raise ConfigError(
                f"model.config.model_type: {model_type!r} contradicts model.preset {self.preset!r}, which is "
                f"{preset_type!r}; drop model.config.model_type or the preset."
            )

    @property
    def source(self) -> ModelSource:
        """Which source builds the model."""
        if self.pretrained_model_name_or_path is not None:
            return "pretrained"
        return "preset" if self.preset is not None else "config"

    def describe(self) -> str:
        """One line naming the model source, for logs."""
        if self.source == "pretrained":
            return f"pretrained weights from {self.pretrained_model_name_or_path}"
        if self.source == "config":
            return f"random weights, config model_type={self.config['model_type']!r}"  # type: ignore[index]
        preset = get_preset(self.preset)  # type: ignore[arg-type]
        overrides = f" with overrides {sorted(self.config)}" if self.config else ""
        return f"random weights, preset {preset.name} ({preset.source}){overrides}"


def with_concrete_dtype(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with ``dtype: auto`` replaced by the dtype it means (said once in an INFO line): the one the pretrained
    checkpoint's config.json names (only that file is read: a local directory, or the Hub / its cache), or the
    ``config`` mapping's (over a preset's); float32 where none is named, as transformers does. Any other ``cfg`` is
    returned as it is."""
    if cfg.dtype != "auto":
        return cfg
    if cfg.pretrained_model_name_or_path is not None:
        source = cfg.pretrained_model_name_or_path
        mapping, where = _checkpoint_config_json(source), f"{source}'s config.json"
    else:
        mapping = {**(get_preset(cfg.preset).config if cfg.preset else {}), **(cfg.config or {})}
        where = "model.config" if cfg.config else f"the preset {cfg.preset}"
    named = str(mapping.get("dtype") or mapping.get("torch_dtype") or "float32").removeprefix("torch.")
    if named not in get_args(ParamDtype):
        raise ConfigError(f"model.dtype: auto is {named!r} in {where}, which remat does not train in; allowed: "
                          f"model.dtype: {', '.join(get_args(ParamDtype))}")
    logger.info("model.dtype: auto -> %s (%s)", named, where)
    return cfg.model_copy(update={"dtype": named})


def _checkpoint_config_json(source: str) -> dict[str, Any]:
    """The config.json of a pretrained model (a directory, or a Hub id: that file alone, downloaded or cached), as
    data; `ConfigError` naming ``model.dtype`` when it cannot be read."""
    local = Path(source).expanduser()
    file = local / "config.json" if local.is_dir() else Path(hub_config_file(source, _DTYPE_KEY))
    try:
        data = json.loads(read_regular_bytes(file, f"{_DTYPE_KEY}:", limit=16 << 20))
    except (ValueError, RecursionError) as err:
        raise ConfigError(f"{_DTYPE_KEY}: auto reads {file}, which is not valid JSON ({type(err).__name__})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{_DTYPE_KEY}: auto reads {file}, which is not a JSON object")
    return data


_DTYPE_KEY = "model.dtype"
