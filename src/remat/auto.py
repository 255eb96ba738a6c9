"""``remat.AutoModelForCausalLM``: the seed's Python entry point. Build a causal LM, then checkpoint and parallelize
it with a ``DistributedSetup``, in one call::

    setup = remat.DistributedSetup.build(strategy="fsdp2", activation_checkpointing=True)
    model = remat.AutoModelForCausalLM.from_pretrained("meta-llama/Llama-3.2-1B", distributed_setup=setup)
    model.remat_plan  # the CheckpointPlan: what each block got

The source is, in this order: an existing local directory (written by ``save_pretrained``), a remat shape preset
(``"llama-3.2-1b"``, ``"tiny-llama"``: random weights), or a Hub id resolved by transformers (downloaded into the
Hugging Face cache, or read from it when offline). ``from_config`` takes a transformers config, a config mapping
with ``model_type``, or a ``remat.models.ModelConfig``. The order of operations is ``DistributedSetup.parallelize``'s:
activation checkpointing, tensor parallelism, then ``fully_shard`` / DDP.

This sits above ``models`` and ``distributed`` and below ``recipes`` (which builds through its own recipe config).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from remat.checkpointing import CheckpointPlan, CheckpointPolicy, apply_activation_checkpointing, parse_policy
from remat.distributed import DistributedSetup
from remat.errors import ConfigError, RematError
from remat.models import ModelConfig, build_model, preset_names
from remat.models.build import model_from_config
from remat.models.document_attention import use_document_attention

#: The attribute holding the `CheckpointPlan` on every model these constructors return.
PLAN_ATTRIBUTE = "remat_plan"

_MODEL_FIELDS = ("dtype", "attn_implementation", "trust_remote_code", "document_attention")


class AutoModelForCausalLM:
    """Like transformers' ``AutoModelForCausalLM``, with ``distributed_setup=`` (or ``activation_checkpointing=`` for
    one process): the returned model is already checkpointed and parallelized, its plan in ``model.remat_plan``.

    What comes back is what a training step calls: the Hugging Face model itself for no setup, ``single`` and
    ``fsdp2`` (``fully_shard`` shards it in place), and torch's ``DistributedDataParallel`` wrapper around it for
    ``ddp`` (the model is its ``.module``; both carry ``remat_plan``). Models are returned in train mode with
    ``use_cache=False``, parameters in float32 unless ``dtype`` says otherwise. Random weights (presets, configs) come
    from torch's global RNG: seed every rank the same (``torch.manual_seed``) for the same weights everywhere.
    """

    def __init__(self) -> None:
        raise TypeError("AutoModelForCausalLM is not instantiated: use AutoModelForCausalLM.from_pretrained(...) "
                        "or AutoModelForCausalLM.from_config(...)")

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike[str],
        *,
        distributed_setup: DistributedSetup | None = None,
        activation_checkpointing: Any = None,
        **hf_kwargs: Any,
    ) -> nn.Module:
        """Build from a local directory, a shape preset or a Hub id (see the module docstring), then apply the setup.

        ``dtype`` (a torch dtype or its name), ``attn_implementation``, ``trust_remote_code`` and
        ``document_attention`` (``"auto"``: packed rows attend per document, no ``[T, T]`` mask) are read by remat;
        the other keyword arguments go to transformers' ``from_pretrained`` (``revision``, ``token``, ``cache_dir``,
        config overrides), or, for a preset, override fields of its config (``num_hidden_layers=2``).
        """
        source = os.fspath(pretrained_model_name_or_path)
        fields, rest = _split_kwargs(hf_kwargs)
        policy = _check_setup(distributed_setup, activation_checkpointing)
        if not os.path.isdir(os.path.expanduser(source)) and source.strip().lower() in preset_names():
            cfg = _model_config(fields, preset=source, config=rest or None)
            rest = {}
        else:
            cfg = _model_config(fields, pretrained_model_name_or_path=source)
        device = distributed_setup.device if distributed_setup else "cpu"
        model = build_model(cfg, device=device, pretrained_kwargs=rest)
        return _prepare(model, cfg, distributed_setup, policy)

    @classmethod
    def from_config(
        cls,
        config: PretrainedConfig | Mapping[str, Any] | ModelConfig,
        *,
        distributed_setup: DistributedSetup | None = None,
        activation_checkpointing: Any = None,
        **kwargs: Any,
    ) -> nn.Module:
        """Random weights for ``config`` (a transformers config, a mapping with ``model_type``, or a ``ModelConfig``),
        then apply the setup. Keyword arguments: ``dtype``, ``attn_implementation``, ``trust_remote_code``,
        ``document_attention``."""
        fields, rest = _split_kwargs(kwargs)
        if rest:
            raise ConfigError(f"from_config: unexpected keyword argument(s) {', '.join(sorted(rest))}; allowed: "
                              f"{', '.join(_MODEL_FIELDS)}, distributed_setup, activation_checkpointing")
        policy = _check_setup(distributed_setup, activation_checkpointing)
        device = distributed_setup.device if distributed_setup else "cpu"
        if isinstance(config, PretrainedConfig):
            cfg = _model_config(fields, config={"model_type": config.model_type})  # dtype & co. checked as usual
            config = copy.deepcopy(config)  # use_cache is switched off on the model's copy, not the caller's
            config.use_cache = False
            dtype = (getattr(config, "dtype", None) or torch.float32) if cfg.dtype == "auto" else getattr(torch, cfg.dtype)
            model = model_from_config(config, dtype=dtype, device=device,
                                      attn_implementation=cfg.attn_implementation,
                                      trust_remote_code=cfg.trust_remote_code)
        elif isinstance(config, ModelConfig):
            cfg = _model_config(fields, **config.model_dump(exclude=set(fields)))
            model = build_model(cfg, device=device)
        elif isinstance(config, Mapping):
            cfg = _model_config(fields, config=dict(config))
            model = build_model(cfg, device=device)
        else:
            raise ConfigError(f"from_config: config must be a transformers PretrainedConfig, a mapping with "
                              f"model_type, or a remat.models.ModelConfig; got {type(config).__name__}")
        return _prepare(model, cfg, distributed_setup, policy)


def _split_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the ModelConfig fields among `kwargs`, dtype given as a torch dtype or its name; everything else)."""
    fields = {name: kwargs[name] for name in _MODEL_FIELDS if name in kwargs}
    if isinstance(fields.get("dtype"), torch.dtype):
        fields["dtype"] = str(fields["dtype"]).removeprefix("torch.")
    return fields, {name: value for name, value in kwargs.items() if name not in _MODEL_FIELDS}


def _model_config(fields: Mapping[str, Any], **source: Any) -> ModelConfig:
    try:
        return ModelConfig(**source, **fields)
    except ValidationError as err:  # one line, naming the argument
        item = err.errors()[0]
        if isinstance(item.get("ctx", {}).get("error"), RematError):
            raise ConfigError(str(item["ctx"]["error"])) from None
        key = ".".join(str(part) for part in item["loc"]) or "model"
        raise ConfigError(f"{key}: {item['msg']} (got {item.get('input')!r})") from None


def _check_setup(setup: DistributedSetup | None, activation_checkpointing: Any) -> CheckpointPolicy:
    """The policy to apply without a setup (parsed before the model is built); the setup's own otherwise."""
    if setup is None:
        return parse_policy(activation_checkpointing, key="activation_checkpointing")
    if activation_checkpointing is not None:
        raise ConfigError("activation_checkpointing: given next to distributed_setup; give it once, as "
                          "DistributedSetup.build(..., activation_checkpointing=...)")
    if setup.root is not None:
        raise ConfigError("distributed_setup: this DistributedSetup already parallelized a model (its plan, root "
                          "and gradient synchronisation belong to that model); build one DistributedSetup per model")
    return parse_policy(setup.activation_checkpointing, key="distributed_setup.activation_checkpointing")


def _prepare(model: PreTrainedModel, cfg: ModelConfig, setup: DistributedSetup | None,
             policy: CheckpointPolicy) -> nn.Module:
    """Document-wise attention (the rows a Python caller trains on may be packed), then checkpoint (exactly once: an
    already checkpointed model is refused) and parallelize; attach the plan."""
    use_document_attention(model, cfg.document_attention, packed=None)
    if setup is not None:
        root = setup.parallelize(model)
        plan = setup.plan
        if setup.context is not None:  # each call's whole rows are cut to this rank's shard before the model runs
            from remat.distributed.context_parallel import cut_model_calls

            cut_model_calls(model, setup.context, setup.sum_over_dp, setup.shard_count)
    else:
        root = model
        plan = apply_activation_checkpointing(model, policy)
    assert isinstance(plan, CheckpointPlan)
    for module in {id(model): model, id(root): root}.values():
        setattr(module, PLAN_ATTRIBUTE, plan)
    return root
