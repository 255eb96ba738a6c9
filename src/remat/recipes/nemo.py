"""A recipe written for NeMo AutoModel's ``llm_finetune``, read as remat's own: key by key mapped where remat has the
meaning (one info line each), or refused with what to write instead. No torch: it runs on the recipe's mapping before
validation (`remat.recipes.loader.load_recipe_data`).

A recipe is read as NeMo's when a ``_target_`` in it names ``nemo_automodel`` or it has a section only NeMo writes
(`NEMO_SECTIONS`). What maps:

- ``model._target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained`` (or ``.from_config``): the model's
  other keys as they are; ``torch_dtype`` is ``model.dtype`` (``bf16`` -> ``bfloat16``; ``auto``, also NeMo's
  default when it is left out, is the checkpoint's config.json dtype, bfloat16 for ``from_config``); ``backend``
  (NeMo's kernels) is dropped: remat runs transformers' attention;
- ``tokenizer`` (``NeMoAutoTokenizer.from_pretrained`` or transformers' ``AutoTokenizer``): the model's own
  tokenizer (dropped) or ``tokenizer.path``; ``add_bos_token`` / ``add_eos_token: true`` are what remat does;
- ``loss_fn._target_``: NeMo's ``MaskedCrossEntropy`` and ``FusedLinearCrossEntropy`` are remat's of the same names;
  Transformer Engine's ``TEParallelCrossEntropy`` at NeMo's defaults is remat's ``MaskedCrossEntropy``;
- ``distributed``: ``_target_`` (``FSDP2Manager``, ``DDPManager``) is the strategy, ``dp_size: none`` is null,
  ``pp_size`` / ``ep_size`` 1 and ``sequence_parallel: false`` are dropped (anything else is refused);
  ``distributed_config.activation_checkpointing`` is the policy;
- ``dist_env.timeout_minutes`` -> ``distributed.timeout_s``; ``rng.seed`` -> ``seed``;
- ``packed_sequence.packed_sequence_size`` N > 0 -> ``dataset.packing: true`` with ``seq_length: N`` (0: packing off);
- ``dataloader`` / ``validation_dataloader``: ``shuffle`` -> the dataset's; the loader and collate classes are
  remat's own;
- ``distributed.mp_policy`` (FSDP2's ``MixedPrecisionPolicy``, reduce in float32) -> ``distributed.mixed_precision``;
  ``distributed.pipeline`` / ``distributed.moe`` sections whose sizes are 1 are dropped (larger sizes refused);
- ``checkpoint``: ``model_save_format`` (``safetensors``, or ``torch_save`` said to be replaced by safetensors) and
  ``save_consolidated`` are what remat writes anyway; ``dequantize_base_checkpoint`` is ``model.dequantize``;
- ``step_scheduler.gc_every_steps`` is dropped;
- ``lr_scheduler``: ``lr_decay_style`` -> ``decay``, ``lr_warmup_steps`` -> ``warmup_steps``, ``min_lr`` ->
  ``min_lr_ratio`` (over ``optimizer.lr``);
- ``peft`` (NeMo's ``PeftConfig``): ``dim`` -> ``r``, ``alpha`` -> ``lora_alpha``, ``dropout`` -> ``lora_dropout``,
  ``match_all_linear: true`` -> ``target_modules: all-linear``;
- ``wandb`` -> ``logging.wandb``; ``recipe``, ``ci`` and ``compile: {enabled: false}`` are dropped.

``step_scheduler.num_epochs`` is remat's own key too (``max_steps`` derived from the data; one written wins).

- ``dataset`` / ``validation_dataset`` built by NeMo's SQuAD, HellaSwag, column-mapped and chat builders
  (`_BUILDERS`): the same Hub dataset or file with remat's ``template`` of the same layout (`remat.data.templates`)
  or ``format: messages``, each argument mapped, dropped with its reason, or refused by name (`_builder`).

Refused, each in one line with the remat spelling: NeMo's other dataset classes, ``compile.enabled: true``, and any
other ``_target_`` of ``nemo_automodel``.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Mapping
from typing import Any, Final

from remat.errors import ConfigError

NEMO_PREFIX: Final[str] = "nemo_automodel"
#: Top-level sections only NeMo AutoModel recipes have.
NEMO_SECTIONS: Final[tuple[str, ...]] = ("dist_env", "rng", "packed_sequence", "dataloader", "validation_dataloader",
                                         "recipe", "distributed_config")
_LOSSES: Final[dict[str, str]] = {
    "nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy": "remat.loss.MaskedCrossEntropy",
    "nemo_automodel.components.loss.linear_ce.FusedLinearCrossEntropy": "remat.loss.FusedLinearCrossEntropy",
}
_TE_CROSS_ENTROPY: Final[str] = "nemo_automodel.components.loss.te_parallel_ce.TEParallelCrossEntropy"
_MODEL_TARGETS: Final[tuple[str, ...]] = ("nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained",
                                          "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
                                          "nemo_automodel._transformers.NeMoAutoModelForCausalLM.from_pretrained")
_STRATEGIES: Final[dict[str, str]] = {"FSDP2Manager": "fsdp2", "DDPManager": "ddp", "FSDP2Config": "fsdp2",
                                      "DDPConfig": "ddp"}
_DTYPES: Final[dict[str, str]] = {"bf16": "bfloat16", "bfloat16": "bfloat16", "torch.bfloat16": "bfloat16",
                                  "fp16": "float16", "float16": "float16", "torch.float16": "float16",
                                  "fp32": "float32", "float32": "float32", "torch.float32": "float32"}
_DATASET_HELP: Final[str] = (
    "remat reads a Hub dataset id, a datasets save_to_disk directory or JSONL: write {key}: {{path: ORG/NAME or DIR, "
    "split: SPLIT, format: prompt_completion (with prompt_field / completion_field), messages or text}}, or "
    "template: squad, hellaswag, columns (with column_mapping), agent_chat or xlam for NeMo's SQuAD, HellaSwag, "
    "column-mapped, agent-trace and xLAM layouts")
_BUILDER_PREFIX: Final[str] = "nemo_automodel.components.datasets.llm."
#: NeMo's dataset builders remat reads (`remat.data.templates`): the template, and the argument naming the data.
_BUILDERS: Final[dict[str, tuple[str, str]]] = {
    _BUILDER_PREFIX + "squad.make_squad_dataset": ("squad", "dataset_name"),
    _BUILDER_PREFIX + "hellaswag.HellaSwag": ("hellaswag", "path_or_dataset"),
    _BUILDER_PREFIX + "column_mapped_text_instruction_dataset.ColumnMappedTextInstructionDataset":
        ("columns", "path_or_dataset_id"),
    _BUILDER_PREFIX + "chat_dataset.ChatDataset": ("chat", "path_or_dataset_id"),
    _BUILDER_PREFIX + "agent_chat.make_agent_chat_dataset": ("agent_chat", "dataset_name"),
    _BUILDER_PREFIX + "xlam.make_xlam_dataset": ("xlam", "dataset_name"),
}
#: The data a builder reads when its recipe names none (NeMo's defaults).
_DEFAULT_DATA: Final[dict[str, str]] = {"squad": "squad", "xlam": "Salesforce/xlam-function-calling-60k"}
#: make_agent_chat_dataset's options remat's ``agent_chat`` template has (``dataset.agent_chat``).
_AGENT_OPTIONS: Final[tuple[str, ...]] = ("trim_incomplete_last_turn", "drop_history_reasoning_content",
                                         "truncate_history", "filter_overlong")
#: make_agent_chat_dataset's options at whose defaults remat does the same.
_AGENT_DEFAULTS: Final[dict[str, bool]] = {"train_on_last_turn_only": False}
#: ChatDataset's options whose defaults are what remat's chat rows do (every assistant turn a target).
_CHAT_DEFAULTS: Final[dict[str, Any]] = {"start_of_turn_token": None, "mask_reasoning_content": False,
                                         "mask_history": False, "unshifted": False, "skip_invalid_samples": False}
#: Each template's own builder argument, for the message that lists what a builder's section may hold.
_OWN_ARG: Final[dict[str, str]] = {"squad": "limit_dataset_samples", "hellaswag": "num_samples_limit",
                                   "columns": "column_mapping, name, limit_dataset_samples, use_hf_chat_template",
                                   "chat": "name",
                                   "agent_chat": "path, limit_dataset_samples, chat_template, filter_no_assistant, "
                                                 "trim_incomplete_last_turn, drop_history_reasoning_content",
                                   "xlam": "limit_dataset_samples"}
#: Builder arguments about padding and truncation: remat cuts its rows to dataset.seq_length itself.
_CUTTING_ARGS: Final[tuple[str, ...]] = ("padding", "truncation", "pad_to_max_length", "fp8")


def is_nemo_recipe(data: Mapping[str, Any]) -> bool:
    """Whether ``data`` reads as a NeMo AutoModel recipe (see the module docstring)."""
    return any(key in data for key in NEMO_SECTIONS) or any(
        isinstance(target, str) and target.startswith(NEMO_PREFIX) for target in _targets(data))


def from_nemo(data: Mapping[str, Any], *, data_needed: bool = True,
              check: Callable[[dict[str, Any]], list[str]] | None = None) -> tuple[dict[str, Any], list[str]]:
    """``data`` in remat's spelling and one line per key mapped or dropped; `ConfigError` with one line per key that
    cannot be read (what to write instead). ``data_needed=False`` (``remat estimate`` / ``plan``, which read no data):
    NeMo's dataset sections are set aside, their ``seq_length`` kept, instead of refused. ``check``: the recipe's own
    validation as problem lines, run on the rest of a refused recipe so that every problem is said in one round.
    """
    out: dict[str, Any] = copy.deepcopy(dict(data))
    said: list[str] = []
    refused: list[str] = []
    if not data_needed:
        _data_set_aside(out, said)
        _layout_for_estimate(out, said)
    for step in (_top_level, _model, _loss, _distributed, _parallelizer, _data, _checkpoint, _schedules, _peft,
                 _extras):
        step(out, said, refused)
    named = {line.split(":", 1)[0] for line in refused}  # a key refused above is not said twice
    leftover = [f"{key}: {target!r}" for key, target in _targets_with_keys(out)
                if isinstance(target, str) and target.startswith(NEMO_PREFIX) and key not in named]
    refused += [f"{item} is NeMo AutoModel's own class, which remat has no counterpart for; remove it or use a remat "
                "target (see docs/recipes.md, 'Coming from NeMo AutoModel')" for item in leftover]
    if refused and check is not None:
        # NOTE [ One round ]: what the recipe's own validation would say of the rest is said now too, so that a
        # user who makes every change asked for meets no second round of refusals. The keys refused above are
        # taken out first, so that none is said twice.
        for key in {line.split(":", 1)[0].split(" ", 1)[0] for line in refused}:
            _remove_key(out, key.removesuffix("._target_"))  # a refused class: its arguments go with it
        if "validation_dataset" not in out and isinstance(out.get("step_scheduler"), dict):
            for key in ("val_every_steps", "val_batches"):
                out["step_scheduler"].pop(key, None)
        refused += [line for line in check(out) if line.split(":", 1)[0] not in {r.split(":", 1)[0] for r in refused}]
    if refused:
        raise ConfigError("a NeMo AutoModel recipe with keys remat cannot read as written:\n" + "\n".join(refused))
    return out, said


def _remove_key(data: dict[str, Any], dotted: str) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        data = data.get(part)  # type: ignore[assignment]
        if not isinstance(data, dict):
            return
    data.pop(last, None)


# ------------------------------------------------------------------------------------------------ sections

def _top_level(out: dict[str, Any], said: list[str], refused: list[str]) -> None:
    for key in ("recipe", "ci"):
        if out.pop(key, None) is not None:
            said.append(f"{key}: dropped (remat finetune is the recipe)" if key == "recipe" else f"{key}: dropped")
    rng = out.pop("rng", None)
    if isinstance(rng, Mapping) and "seed" in rng:
        out.setdefault("seed", rng["seed"])
        said.append(f"rng.seed {rng['seed']} -> seed (remat seeds Python, NumPy and torch alike on every rank)")
    dist_env = out.pop("dist_env", None)
    if isinstance(dist_env, Mapping):
        minutes = dist_env.get("timeout_minutes")
        if minutes is not None and not _positive_number(minutes):
            refused.append(f"dist_env.timeout_minutes: got {minutes!r}; allowed: a positive number of minutes")
        elif minutes is not None:
            _section(out, "distributed")["timeout_s"] = float(minutes) * 60
            said.append(f"dist_env.timeout_minutes {minutes} -> distributed.timeout_s {float(minutes) * 60:g}")
        if "backend" in dist_env:
            said.append(f"dist_env.backend {dist_env['backend']!r}: dropped (remat uses NCCL on GPUs, gloo on CPUs)")
    _compile(out, said, refused)
    wandb = out.pop("wandb", None)
    if isinstance(wandb, Mapping):
        _wandb(wandb, out, said, refused)


#: NeMo's ``wandb`` keys that are remat's ``logging.wandb`` keys.
_WANDB_KEYS: Final[tuple[str, ...]] = ("project", "entity", "name", "group", "tags", "mode")


def _wandb(wandb: Mapping[str, Any], out: dict[str, Any], said: list[str], refused: list[str]) -> None:
    """NeMo's ``wandb`` section: ``logging.wandb`` unless ``enable: false`` (then no Weights & Biases logging)."""
    if wandb.get("enable", True) is False:
        said.append("wandb: dropped (enable: false; remat logs to Weights & Biases only with a logging.wandb section)")
        return
    for key in sorted(set(wandb) - {*_WANDB_KEYS, "enable", "dir", "save_dir"}):
        refused.append(f"wandb.{key}: not a Weights & Biases setting remat passes; allowed: {', '.join(_WANDB_KEYS)}, "
                       "enable, dir")
    _section(out, "logging")["wandb"] = {key: wandb[key] for key in _WANDB_KEYS if key in wandb}
    dropped = [key for key in ("dir", "save_dir") if key in wandb]
    said.append("wandb -> logging.wandb" + (f" ({', '.join(dropped)} dropped: wandb writes in the run's output_dir)"
                                            if dropped else ""))


def _compile(out: dict[str, Any], said: list[str], refused: list[str]) -> None:
    """NeMo's ``compile`` section: remat's own (`remat.recipes.config.CompileConfig`: each block compiled after
    checkpointing), ``backend: null`` being inductor; switched off, dropped."""
    section = out.pop("compile", None)
    if not isinstance(section, Mapping) or not section.get("enabled"):
        if section is not None:
            said.append("compile: dropped (not enabled)")
        return
    unknown = sorted(set(section) - {"enabled", "mode", "fullgraph", "dynamic", "backend"})
    if unknown:
        refused.append(f"compile.{unknown[0]}: not a torch.compile option remat passes; allowed: enabled, backend, "
                       "mode, fullgraph, dynamic")
        return
    out["compile"] = {"enabled": True, "backend": section.get("backend") or "inductor", "mode": section.get("mode"),
                      "fullgraph": bool(section.get("fullgraph", False)), "dynamic": section.get("dynamic")}
    said.append("compile (enabled) -> compile: torch.compile of each decoder block after checkpointing wraps it, "
                f"backend {out['compile']['backend']}")


def _model(out: dict[str, Any], said: list[str], refused: list[str]) -> None:
    model = out.get("model")
    if not isinstance(model, dict):
        return
    target = model.pop("_target_", None)
    if target is not None:
        if target not in _MODEL_TARGETS:
            refused.append(f"model._target_: {target!r} is not a model remat builds; allowed: "
                           "nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained, or remat's model keys "
                           "(pretrained_model_name_or_path, preset, config)")
        else:
            said.append(f"model._target_ {target.rsplit('.', 2)[-2]}.{target.rsplit('.', 1)[-1]} -> remat's own "
                        "model build (transformers' AutoModelForCausalLM)")
    if model.get("trust_remote_code") is True:
        del model["trust_remote_code"]
        said.append("model.trust_remote_code true: not carried over (in remat only the command line switches on a "
                    "model's own code: transformers' own architectures need none, and a model that ships code is "
                    "refused when it loads unless you run with --trust-remote-code)")
    written = "torch_dtype" in model
    default = "auto" if target in _MODEL_TARGETS and "dtype" not in model else ""
    dtype = str(model.pop("torch_dtype", default))
    if dtype == "auto":  # NeMo's default too: from_pretrained keeps the checkpoint's dtype, from_config bfloat16
        _auto_dtype(model, str(target), written, said)
    elif dtype and dtype not in _DTYPES:
        refused.append(f"model.torch_dtype: got {dtype!r}; allowed: {', '.join(sorted(set(_DTYPES)))}")
    elif dtype:
        model["dtype"] = _DTYPES[dtype]
        said.append(f"model.torch_dtype {dtype} -> model.dtype {_DTYPES[dtype]}")
    if model.pop("backend", None) is not None:
        said.append("model.backend (NeMo's kernels): dropped; remat runs transformers' attention and layers")
    _tokenizer(out, model, said, refused)


def _auto_dtype(model: dict[str, Any], target: str, written: bool, said: list[str]) -> None:
    """``torch_dtype: auto``, ``written`` or NeMo's default: bfloat16 for NeMo's ``from_config`` (its own rule), else
    remat's ``model.dtype: auto`` (transformers' rule: the checkpoint's config.json dtype, read when the model is
    first needed, so the recipe reads without the checkpoint)."""
    key = "model.torch_dtype auto" + ("" if written else " (NeMo's default)")
    if target.endswith(".from_config"):
        model["dtype"] = "bfloat16"
        said.append(f"{key} -> model.dtype bfloat16 (NeMo's from_config builds auto in bfloat16)")
        return
    model["dtype"] = "auto"
    said.append(f"{key} -> model.dtype auto (the dtype the checkpoint's config.json names)")


def _tokenizer(out: dict[str, Any], model: Mapping[str, Any], said: list[str], refused: list[str]) -> None:
    """NeMo's ``tokenizer: {_target_: ...NeMoAutoTokenizer.from_pretrained, pretrained_model_name_or_path: P}``:
    the model's own tokenizer (remat's default) when P is the model's, else ``tokenizer.path: P``."""
    section = out.get("tokenizer")
    target = section.get("_target_") if isinstance(section, dict) else None
    if not isinstance(target, str) or not target.rsplit(".", 2)[-2:][0].endswith("AutoTokenizer"):
        return
    source = section.get("pretrained_model_name_or_path")
    # remat frames every document with BOS and EOS (remat.data.formats.add_document_specials): NeMo's flags that ask
    # for them are what remat does; asking for a document without them is not.
    specials = {name: section[name] for name in ("add_bos_token", "add_eos_token") if name in section}
    extra = sorted(set(section) - {"_target_", "pretrained_model_name_or_path", "trust_remote_code", *specials})
    for name, value in specials.items():
        if value is not True:
            refused.append(f"tokenizer.{name}: {value!r}; remat puts BOS in front of every document and EOS at its "
                           "end; allowed: true (or remove the key)")
    if extra:
        refused.append(f"tokenizer: {', '.join(extra)} of {target.rsplit('.', 2)[-2]} have no remat counterpart; "
                       "allowed: pretrained_model_name_or_path (remat loads that tokenizer as it is)")
    if extra or any(value is not True for value in specials.values()):
        section.pop("_target_", None)  # refused above: not said again as NeMo's own class
        return
    if specials:
        said.append(f"tokenizer: {', '.join(specials)} true dropped (remat puts BOS in front of every document and "
                    "EOS at its end)")
    if source in (None, model.get("pretrained_model_name_or_path")):
        del out["tokenizer"]
        said.append(f"tokenizer ({target.rsplit('.', 2)[-2]} of the model): dropped (remat loads the model's own "
                    "tokenizer)")
    else:
        out["tokenizer"] = {"path": source}
        said.append(f"tokenizer ({target.rsplit('.', 2)[-2]}) -> tokenizer.path {source}")


def _loss(out: dict[str, Any], said: list[str], refused: list[str]) -> None:
    loss = out.get("loss_fn")
    target = loss.get("_target_") if isinstance(loss, dict) else None
    if not isinstance(target, str) or not target.startswith(NEMO_PREFIX):
        return
    if target in _LOSSES:
        loss["_target_"] = _LOSSES[target]
        said.append(f"loss_fn._target_ {target} -> {_LOSSES[target]}")
    elif target == _TE_CROSS_ENTROPY:
        _te_cross_entropy(out, loss, said, refused)
    else:
        refused.append(f"loss_fn._target_: {target!r} has no remat counterpart; allowed: "
                       f"{', '.join(_LOSSES.values())}")


def _te_cross_entropy(out: dict[str, Any], loss: dict[str, Any], said: list[str], refused: list[str]) -> None:
    """Transformer Engine's cross-entropy at NeMo's defaults (``ignore_index: -100``, ``reduction: sum``, divided by
    the step's label count) is the loss of remat's ``MaskedCrossEntropy``: mapped, with its kernel said to be
    remat's. Any other argument (a ``tp_group``, another reduction) is refused by name."""
    others = {key: value for key, value in loss.items() if key != "_target_"
              and (key, value) not in (("ignore_index", -100), ("reduction", "sum"))}
    if others:
        refused.append(f"loss_fn: {', '.join(f'{key}={value!r}' for key, value in others.items())} of "
                       "TEParallelCrossEntropy; remat reads it at NeMo's defaults only (ignore_index -100, "
                       "reduction sum over the step's labelled tokens): remove them")
        return
    out["loss_fn"] = {"_target_": "remat.loss.MaskedCrossEntropy"}
    said.append(f"loss_fn._target_ {_TE_CROSS_ENTROPY} -> remat.loss.MaskedCrossEntropy (the same loss: the sum "
                "over the labelled tokens divided by their count; remat's kernel in place of Transformer Engine's)")


def _distributed(out: dict[str, Any], said: list[str], refused: list[str]) -> None:
    config = out.pop("distributed_config", None)
    section = out.get("distributed")
    if not isinstance(section, dict):
        if config is None:
            return
        section = _section(out, "distributed")
    for source, name in ((section, "distributed"), (config if isinstance(config, Mapping) else {},
                                                    "distributed_config")):
        target = source.get("_target_")
        if isinstance(target, str):
            strategy = _STRATEGIES.get(target.rsplit(".", 1)[-1])
            if strategy is None:
                refused.append(f"{name}._target_: {target!r}; allowed: FSDP2Manager or DDPManager (strategy fsdp2 "
                               "or ddp)")
            else:
                section["strategy"] = strategy
                said.append(f"{name}._target_ {target.rsplit('.', 1)[-1]} -> distributed.strategy {strategy}")
        if name == "distributed_config" and "activation_checkpointing" in source:
            section["activation_checkpointing"] = source["activation_checkpointing"]
            said.append("distributed_config.activation_checkpointing -> distributed.activation_checkpointing")
    section.pop("_target_", None)
    if isinstance(section.get("dp_size"), str) and section["dp_size"].lower() in ("none", "null", "auto"):
        section["dp_size"] = None
        said.append("distributed.dp_size none -> null (derived from the number of processes)")
    _mixed_precision(section, said, refused)
    for name in ("pipeline", "moe"):
        _trivial_section(section, name, said, refused)
    for key, trivial in (("pp_size", 1), ("ep_size", 1), ("sequence_parallel", False), ("dp_replicate_size", 1)):
        if key not in section:
            continue
        value = section.pop(key)
        if value in (trivial, None):
            shown = str(value).lower() if isinstance(value, bool) else value
            said.append(f"distributed.{key} {shown}: dropped (what remat does)")
        else:
            refused.append(f"distributed.{key}: {value!r} is not supported by remat (pipeline, expert and sequence "
                           "parallelism); allowed: " + ("false" if trivial is False else "1") + ", with FSDP2 over "
                           "the same GPUs instead (remat estimate RECIPE says what that layout holds per GPU), or "
                           "context parallelism: distributed.cp_size")


#: NeMo's ``distributed.mp_policy`` (an FSDP2 ``MixedPrecisionPolicy``): what remat's ``mixed_precision: D`` is.
_REMAT_MP_REDUCE: Final[str] = "float32"
#: Sizes of NeMo's ``distributed.pipeline`` / ``distributed.moe`` sections that ask for nothing (one stage, no expert
#: parallelism): such a section is dropped; any other value is refused by name.
_TRIVIAL_SIZES: Final[dict[str, Any]] = {"pp_size": 1, "ep_size": 1, "size": 1, "num_stages": 1, "enabled": False}


def _mixed_precision(section: dict[str, Any], said: list[str], refused: list[str]) -> None:
    policy = section.pop("mp_policy", None)
    if policy is None:
        return
    dtypes = {key: _DTYPES.get(str(policy.get(key)).removeprefix("torch."), str(policy.get(key)))
              for key in ("param_dtype", "reduce_dtype")} if isinstance(policy, Mapping) else {}
    param = dtypes.get("param_dtype")
    if param not in ("bfloat16", "float16", "float32") or dtypes.get("reduce_dtype") not in (_REMAT_MP_REDUCE,
                                                                                              "None", None):
        refused.append(f"distributed.mp_policy: {dict(policy) if isinstance(policy, Mapping) else policy!r}; remat's "
                       "distributed.mixed_precision: D is FSDP2's MixedPrecisionPolicy(param_dtype=D, reduce_dtype="
                       "float32): allowed: param_dtype bfloat16, float16 or float32 with reduce_dtype float32")
        return
    section["mixed_precision"] = param
    said.append(f"distributed.mp_policy (param_dtype {param}, reduce_dtype float32) -> distributed.mixed_precision "
                f"{param}")


def _trivial_section(section: dict[str, Any], name: str, said: list[str], refused: list[str]) -> None:
    value = section.pop(name, None)
    if value is None:
        return
    asks = {key: item for key, item in value.items() if key != "_target_" and key in _TRIVIAL_SIZES
            and item not in (_TRIVIAL_SIZES[key], None)} if isinstance(value, Mapping) else {"": value}
    if asks:
        refused.append(f"distributed.{name}: {', '.join(f'{k}={v!r}' for k, v in asks.items())} asks for "
                       f"{'pipeline' if name == 'pipeline' else 'expert'} parallelism, which remat does not have; "
                       "allowed: sizes 1 (or no section), and FSDP2 over the same GPUs instead (remat estimate "
                       "RECIPE says what that layout holds per GPU)")
    else:
        said.append(f"distributed.{name}: dropped (its sizes are 1: nothing remat lacks)")


# NOTE [ The estimate of what remat would run ]
# `remat estimate` and `remat plan` of a NeMo recipe answer for the run remat would make of it on the same GPUs: a
# recipe asking for pipeline or expert parallelism is refused for training (remat has neither), but its user's
# question is what FSDP2 over those GPUs would hold. So for a command that reads no data those keys become that
# layout, each said in a line with what the estimate leaves out; training still refuses them by name.
def _layout_for_estimate(out: dict[str, Any], said: list[str]) -> None:
    """For a command that only estimates (NOTE [ The estimate of what remat would run ]): pipeline and expert
    parallelism, sequence parallelism and Transformer Engine's FusedAdam, which remat does not run, as what it would
    run on the same GPUs, each said with what the estimate leaves out."""
    section = out.get("distributed")
    if isinstance(section, dict):
        stages = _size(section, "pp_size", "pipeline")
        if stages > 1:
            dp = section.get("dp_size")
            if isinstance(dp, int) and not isinstance(dp, bool):
                section["dp_size"] = dp * stages
            said.append(f"distributed.pp_size {stages}: estimated as FSDP2 over the same GPUs, the pipeline stages' "
                        "ranks data-parallel" + (f" (dp_size {dp} -> {dp * stages})" if isinstance(dp, int) else "")
                        + "; remat has no pipeline parallelism")
        experts = _size(section, "ep_size", "moe")
        if experts > 1:
            said.append(f"distributed.ep_size {experts}: estimated as FSDP2 over the same GPUs, the experts sharded "
                        "over the data-parallel ranks like every other layer; remat has no expert parallelism")
        if section.get("sequence_parallel") is True:
            del section["sequence_parallel"]
            said.append("distributed.sequence_parallel: estimated without it (the norms' activations are not split "
                        "over the tensor-parallel ranks: an upper bound)")
    optimizer = out.get("optimizer")
    if isinstance(optimizer, dict) and str(optimizer.get("_target_", "")).endswith(".FusedAdam") and str(
            optimizer["_target_"]).startswith("transformer_engine."):
        kept = {key: optimizer[key] for key in ("lr", "betas", "eps", "weight_decay") if key in optimizer}
        extra = [what for key, what in (("master_weights", "float32 master weights"),
                                        ("exp_avg_dtype", "moments in exp_avg_dtype")) if optimizer.get(key)]
        out["optimizer"] = {"_target_": "torch.optim.AdamW", **kept}
        said.append("optimizer._target_ transformer_engine FusedAdam: estimated as torch.optim.AdamW (moments in the "
                    "parameters' dtype)" + (f"; its {' and '.join(extra)} are not in this estimate" if extra else ""))


def _size(section: dict[str, Any], key: str, nested: str) -> int:
    """``distributed.<key>`` or its nested section's size, both taken out of ``section``; 1 when neither asks."""
    sizes = [section.pop(key, None)]
    inner = section.get(nested)
    if isinstance(inner, Mapping) and any(inner.get(k) not in (v, None) for k, v in _TRIVIAL_SIZES.items()):
        section.pop(nested)
        sizes += [inner.get(name) for name in (key, "size", "num_stages")]
    return max((size for size in sizes if isinstance(size, int) and not isinstance(size, bool)), default=1)


def _data_set_aside(out: dict[str, Any], said: list[str]) -> None:
    """For a command that reads no data: NeMo's dataset sections (builder classes and their arguments) replaced by
    their ``seq_length``, the one thing of theirs a step's shape needs."""
    for key in ("dataset", "validation_dataset"):
        section = out.get(key)
        if not (isinstance(section, dict) and isinstance(section.get("_target_"), str)):
            continue
        kept = {name: section[name] for name in ("seq_length",) if name in section}
        out[key] = kept if key == "dataset" else None
        if key == "dataset":
            said.append(f"dataset._target_ {section['_target_'].rsplit('.', 1)[-1]}: not read (this command reads no "
                        "data)" + (f"; seq_length {kept['seq_length']} kept" if kept else "; give the row length with "
                                   "dataset.seq_length or --seq-length"))
        else:
            said.append("validation_dataset: not read (this command reads no data)")
    if "validation_dataset" in out and out["validation_dataset"] is None:
        del out["validation_dataset"]
        sched = out.get("step_scheduler")
        for key in ("val_every_steps", "val_batches"):  # validation is not part of the step estimated
            if isinstance(sched, dict):
                sched.pop(key, None)


def _data(out: dict[str, Any], said: list[str], refused: list[str]) -> None:
    for key in ("dataset", "validation_dataset"):
        section = out.get(key)
        target = section.get("_target_") if isinstance(section, dict) else None
        if target == _MOCK_BUILDER:
            out[key] = _mock_builder(key, section, said, refused)
        elif isinstance(target, str) and target in _BUILDERS:
            out[key] = _builder(key, section, out.get("model"), said, refused)
        elif isinstance(target, str):
            refused.append(f"{key}._target_: {target!r} is NeMo's dataset code, which remat has no counterpart for; "
                           f"{_DATASET_HELP.format(key=key)}")
            del section["_target_"]  # said once, here
    packed = out.pop("packed_sequence", None)
    size_value = packed.get("packed_sequence_size") if isinstance(packed, Mapping) else None
    if size_value is not None and (isinstance(size_value, bool) or not isinstance(size_value, int) or size_value < 0):
        refused.append(f"packed_sequence.packed_sequence_size: got {size_value!r}; allowed: 0 (no packing) or a "
                       "positive number of tokens")
    elif isinstance(packed, Mapping) and "packed_sequence_size" in packed:
        size = int(packed["packed_sequence_size"] or 0)
        dataset = _section(out, "dataset")
        if size > 0:
            dataset.update(packing=True, seq_length=size)
            said.append(f"packed_sequence.packed_sequence_size {size} -> dataset.packing true, dataset.seq_length "
                        f"{size} (packed rows attend per document)")
        else:
            dataset["packing"] = False
            said.append("packed_sequence.packed_sequence_size 0 -> dataset.packing false")
    if isinstance(packed, Mapping):
        _packing_options(packed, said, refused)
    for loader, dataset_key in (("dataloader", "dataset"), ("validation_dataloader", "validation_dataset")):
        section = out.pop(loader, None)
        if not isinstance(section, Mapping):
            continue
        if "shuffle" in section and isinstance(out.get(dataset_key), dict):
            out[dataset_key]["shuffle"] = bool(section["shuffle"])
        said.append(f"{loader}: remat's own loader and collation" +
                    (f" (shuffle -> {dataset_key}.shuffle)" if "shuffle" in section else ""))


#: NeMo's builder of random token ids, and its arguments (remat's ``dataset.mock``).
_MOCK_BUILDER: Final[str] = _BUILDER_PREFIX + "mock.build_unpacked_dataset"
_MOCK_ARGS: Final[tuple[str, ...]] = ("num_sentences", "mean_len", "std_len", "vocab_size", "max_sentence_len", "seed")


def _mock_builder(key: str, section: dict[str, Any], said: list[str], refused: list[str]) -> dict[str, Any]:
    """NeMo's mock builder as ``dataset.mock`` (the same ids for the same seed, `remat.data.sources`): rows as long as
    the longest sentence and its end id, one sentence each."""
    args = {name: value for name, value in section.items() if name not in ("_target_", "tokenizer")}
    for name in sorted(set(args) - set(_MOCK_ARGS)):
        refused.append(f"{key}.{name}: not an argument of NeMo's mock builder remat reads; allowed: "
                       f"{', '.join(_MOCK_ARGS)}")
    mock = {name: args[name] for name in _MOCK_ARGS if name in args}
    longest = -(-(int(mock.get("max_sentence_len", 64)) + 1) // 16) * 16  # padded to a multiple of 16, as FP8 needs
    said.append(f"{key}._target_ build_unpacked_dataset -> {key}.mock (the same random token ids for the seed; "
                f"format tokens, rows of seq_length {longest}: the longest sentence and its end id, padded to a "
                "multiple of 16)")
    return {"mock": mock, "format": "tokens", "packing": False, "seq_length": longest}


def _builder(key: str, section: dict[str, Any], model: Any, said: list[str], refused: list[str]) -> dict[str, Any]:
    """A NeMo dataset builder's section as remat's dataset section: the same rows, prompts and answers
    (`remat.data.templates`, or chat rows as ``format: messages``), each argument mapped, dropped with its reason,
    or refused by name."""
    args = {name: value for name, value in section.items() if name != "_target_"}
    builder = section["_target_"].rsplit(".", 1)[-1]
    kind, source = _BUILDERS[section["_target_"]]
    if kind == "agent_chat" and "path" in args and "dataset_name" not in args:
        source = "path"  # its local JSON files
    path = args.pop(source, _DEFAULT_DATA.get(kind))
    if not (isinstance(path, str) and path.strip()) and not (isinstance(path, list) and path):
        refused.append(f"{key}.{source}: got {path!r}; allowed: a Hub dataset id or a local file ({builder})")
        path = "missing"
    mapped: dict[str, Any] = {"path": path, "packing": False}  # packed_sequence packs
    mapped.update({"format": "messages"} if kind == "chat" else {"template": kind})
    notes = [f"{source} -> path"]
    split = args.pop("split", "train")
    first = path if isinstance(path, str) else path[0]
    if first.startswith((".", "/", "~")) or first.endswith((".jsonl", ".json")):
        notes.append(f"split {split!r} dropped (a local file has no splits)")
    else:
        mapped["split"] = split
    for name, to in (("limit_dataset_samples", "max_samples"), ("num_samples_limit", "max_samples"),
                     ("seq_length", "seq_length"), ("column_mapping", "column_mapping"), ("name", "name"),
                     ("chat_template", "chat_template")):
        if args.get(name) is not None:
            mapped[to] = args.pop(name)
            notes.append(f"{name} kept" if name == to else f"{name} -> {to}")
        args.pop(name, None)
    if kind == "columns":
        # NeMo renders a chat only when asked (and the tokenizer has a template); remat's unset is the same "when
        # the tokenizer has one".
        mapped["use_chat_template"] = None if args.pop("use_hf_chat_template", False) else False
    if kind == "agent_chat":
        _agent_options(key, args, mapped, notes, refused)
    _builder_options(key, args, model, notes, refused)
    for name in args:
        refused.append(f"{key}.{name}: an argument of NeMo's {builder} that remat has no counterpart for; allowed: "
                       f"{source}, split, seq_length, {_OWN_ARG[kind]}, padding, truncation")
    to = f"{key}.format messages" if kind == "chat" else f"{key}.template {kind}"
    said.append(f"{key}._target_ {builder} -> {to} ({'; '.join(notes)})")
    return mapped


def _agent_options(key: str, args: dict[str, Any], mapped: dict[str, Any], notes: list[str],
                   refused: list[str]) -> None:
    """make_agent_chat_dataset's trace options (taken out of ``args``): ``dataset.agent_chat``, what remat does, or
    refused by name."""
    if mapped.get("seq_length") is not None and not args.get("truncation") and not args.get("filter_overlong"):
        notes.append(f"seq_length {mapped['seq_length']}: remat cuts every row at it (NeMo's builder without "
                     "truncation passes a longer trace whole)")
    if args.get("revision") is not None:
        mapped["revision"] = args.pop("revision")
        notes.append("revision kept")
    options = {name: bool(args.pop(name)) for name in _AGENT_OPTIONS if name in args}
    if any(options.values()):
        mapped["agent_chat"] = {name: value for name, value in options.items() if value}
        notes.append(f"{', '.join(name for name, value in options.items() if value)} -> {key}.agent_chat")
    if "filter_no_assistant" in args:
        args.pop("filter_no_assistant")
        notes.append("filter_no_assistant dropped (a row without an assistant turn has no loss target, and remat "
                     "drops such rows with a count)")
    _only_defaults(key, args, _AGENT_DEFAULTS, "remat trains on every assistant turn of a trace", refused)


def _only_defaults(key: str, args: dict[str, Any], defaults: Mapping[str, Any], what_remat_does: str,
                   refused: list[str]) -> None:
    """The builder arguments of ``defaults`` taken out of ``args``; one refused by name unless at its default."""
    for name, default in defaults.items():
        value = args.pop(name, default)
        if value != default:
            refused.append(f"{key}.{name}: {value!r}; {what_remat_does}; allowed: {default!r} (or remove the key)")


def _builder_options(key: str, args: dict[str, Any], model: Any, notes: list[str], refused: list[str]) -> None:
    """The builder arguments about cutting, masking and tokenizing rows (taken out of ``args``): dropped where remat
    does the same, refused where it does not."""
    cutting = [name for name in _CUTTING_ARGS if args.pop(name, None) is not None]
    if cutting:
        notes.append(f"{', '.join(cutting)} dropped (remat cuts rows to seq_length itself: packed, or padded)")
    if args.pop("answer_only_loss_mask", True) is not True:
        refused.append(f"{key}.answer_only_loss_mask: false; remat's templates put the loss on the answer only; "
                       "allowed: true (or remove it), or a text dataset (format: text) for a loss on every token")
    _only_defaults(key, args, _CHAT_DEFAULTS, "remat's chat rows train on every assistant turn's text as the "
                   "tokenizer's chat template renders it", refused)
    _builder_tokenizer(key, args.pop("tokenizer", None), model, notes, refused)
    if args.pop("shuffle_seed", None) is not None:
        notes.append("shuffle_seed dropped (remat shuffles with the recipe's seed)")


def _builder_tokenizer(key: str, tokenizer: Any, model: Any, notes: list[str], refused: list[str]) -> None:
    """A builder's own ``tokenizer`` section: dropped when it is the model's (the recipe's tokenizer tokenizes the
    rows), else refused with the top-level key that says it."""
    if tokenizer is None:
        return
    source = tokenizer.get("pretrained_model_name_or_path") if isinstance(tokenizer, Mapping) else None
    own = model.get("pretrained_model_name_or_path") if isinstance(model, Mapping) else None
    if source is None or source == own:
        cut = isinstance(tokenizer, Mapping) and "truncation_side" in tokenizer
        notes.append("tokenizer dropped (the model's, which the recipe loads" +
                     ("; truncation_side dropped: remat cuts rows at their end" if cut else "") + ")")
        return
    refused.append(f"{key}.tokenizer: {source!r} is not the model's tokenizer; remat tokenizes every dataset with the "
                   f"recipe's one: allowed: tokenizer: {{path: {source}}} at the top of the recipe (a local directory)")


#: NeMo keys with nothing to do in remat: (section, key) -> why dropping them changes nothing.
_DROPPED: Final[dict[tuple[str, str], str]] = {
    ("model", "force_hf"): "remat always builds transformers' own implementation",
    ("model", "use_liger_kernel"): "remat's fused loss and transformers' layers run instead",
    ("peft", "use_memory_efficient_lora"): "NeMo's fused LoRA kernel; remat trains PEFT's LoRA, the same adapters",
    ("step_scheduler", "log_remote_every_steps"): "remat logs every step to its metrics file and wandb",
    ("", "skypilot"): "a launcher's section: remat runs where it is started (torchrun for several processes)",
    ("", "nvtx"): "NVTX ranges for Nsight Systems; remat profile gives remat's own per-op profile",
    ("model", "use_sdpa_patching"): "NeMo's patch of transformers' attention; remat runs transformers' SDPA",
    ("step_scheduler", "loss_average_window_steps"): "remat logs each step's loss; its report smooths the curve",
    ("step_scheduler", "save_checkpoint_every_epoch"): "remat saves every ckpt_every_steps and at the end of the run",
    ("", "tool_call_eval"): "NeMo's tool-call accuracy evaluator, a metric beside training; remat validates with the "
                            "validation dataset's loss",
}


def _extras(out: dict[str, Any], said: list[str], refused: list[str]) -> None:
    """The NeMo keys of no section above: dropped with the reason nothing changes, mapped, or refused by name."""
    for (section_name, key), why in _DROPPED.items():
        section = out.get(section_name) if section_name else out
        if isinstance(section, dict) and key in section:
            section.pop(key)
            said.append(f"{section_name + '.' if section_name else ''}{key}: dropped ({why})")
    if "quantization" in out:
        quantization = out.pop("quantization")
        if isinstance(quantization, Mapping) and isinstance(out.get("model"), dict):
            out["model"]["quantization"] = dict(quantization)
            said.append("quantization -> model.quantization (the base weights quantised to 4 bits by bitsandbytes as "
                        "they load, LoRA adapters trained over them: QLoRA; the same keys)")
        else:
            refused.append(f"quantization: {quantization!r}; allowed: a mapping of bitsandbytes keys (load_in_4bit, "
                           "bnb_4bit_quant_type, ...), which remat reads as model.quantization")
    repair = out.pop("embedding_row_repair", None)
    if isinstance(repair, Mapping) and isinstance(out.get("model"), dict):
        if repair.get("enabled", True) is not False:
            out["model"]["embedding_row_repair"] = {key: value for key, value in repair.items() if key != "enabled"}
        said.append("embedding_row_repair -> model.embedding_row_repair (the same repair of input-embedding rows "
                    "left at zero, before anything wraps the model)" if repair.get("enabled", True) is not False
                    else "embedding_row_repair: dropped (not enabled)")
    neftune = out.pop("neftune", None)
    if isinstance(neftune, Mapping) and set(neftune) <= {"noise_alpha"} and neftune.get("noise_alpha") is not None:
        _section(out, "training")["neftune_noise_alpha"] = neftune["noise_alpha"]
        said.append(f"neftune.noise_alpha {neftune['noise_alpha']} -> training.neftune_noise_alpha (transformers' "
                    "NEFTune hook on the input embeddings)")
    elif neftune is not None:
        refused.append(f"neftune: {neftune!r}; allowed: {{noise_alpha: A}} (training.neftune_noise_alpha)")
    fp8 = out.get("fp8")
    if isinstance(fp8, dict):
        if fp8.get("recipe_name", "") is None:  # NeMo's None is tensorwise scaling, remat's default
            del fp8["recipe_name"]
        said.append("fp8: read as it is (torchao's FP8 training of the linear layers, the same keys)" if
                    fp8.get("enabled") else "fp8: read as it is (not enabled)")
    qat = out.get("qat")
    if isinstance(qat, dict):
        _qat(qat, said, refused)
    if "validation_dataset" in out and out["validation_dataset"] in (None, "none", "None", "null"):
        del out["validation_dataset"]
        said.append("validation_dataset none -> no validation")
    schedule = out.get("step_scheduler")
    if "validation_dataset" not in out and isinstance(schedule, dict) and "val_every_steps" in schedule:
        said.append(f"step_scheduler.val_every_steps {schedule.pop('val_every_steps')}: dropped (no "
                    "validation_dataset: NeMo validates nothing then)")
    _extras_model(out.get("model"), said, refused)
    _extras_distributed(out.get("distributed"), said, refused)


def _extras_model(model: Any, said: list[str], refused: list[str]) -> None:
    """NeMo's model switches: the base weights, FlashAttention, multi-token prediction."""
    if not isinstance(model, dict):
        return
    if model.get("load_base_model") is True:
        del model["load_base_model"]
        said.append("model.load_base_model true: dropped (remat loads the weights of pretrained_model_name_or_path)")
    _config_of_the_checkpoint(model, said)
    if model.get("attn_implementation") == "flash_attention_2":
        model["attn_implementation"] = "sdpa"
        said.append("model.attn_implementation flash_attention_2 -> sdpa (PyTorch's attention runs FlashAttention "
                    "kernels on the GPU; packed rows attend per document with remat's document attention)")
    mtp = sorted(key for key in model if key.startswith(("mtp_", "num_nextn_")))
    if mtp:
        refused.append(f"model.{mtp[0]}: multi-token prediction ({', '.join(mtp)}); remat trains the next-token "
                       "loss only: remove the keys")


#: What NeMo's ``model.config: {_target_: AutoConfig.from_pretrained, ...}`` of the model's own checkpoint may hold
#: besides the checkpoint: keys remat reads from the model section itself.
_CONFIG_LOADER_KEYS: Final[frozenset[str]] = frozenset({"_target_", "pretrained_model_name_or_path", "trust_remote_code",
                                                        "attn_implementation", "attn_implementation_new",
                                                        "_attn_implementation"})


def _config_of_the_checkpoint(model: dict[str, Any], said: list[str]) -> None:
    """``model.config`` as transformers' ``AutoConfig.from_pretrained`` of the checkpoint ``model`` loads anyway: that
    config is what remat builds from (dropped); an attention implementation in it is the model's own key."""
    config = model.get("config")
    if not (isinstance(config, Mapping) and str(config.get("_target_", "")).endswith("AutoConfig.from_pretrained")
            and config.get("pretrained_model_name_or_path") == model.get("pretrained_model_name_or_path")
            and set(config) <= _CONFIG_LOADER_KEYS):
        return
    del model["config"]
    attention = {config.get(key) for key in ("attn_implementation", "attn_implementation_new",
                                             "_attn_implementation")} - {None}
    if len(attention) == 1 and "attn_implementation" not in model:
        model["attn_implementation"] = attention.pop()
    said.append("model.config (AutoConfig.from_pretrained of the same checkpoint): dropped (remat builds from that "
                "checkpoint's config.json)" + ("; its attention implementation -> model.attn_implementation"
                                               if "attn_implementation" in model else ""))


def _extras_distributed(distributed: Any, said: list[str], refused: list[str]) -> None:
    """NeMo's FSDP switches: when gradients are reduced, resharding, Megatron's FSDP."""
    if not isinstance(distributed, dict):
        return
    if "defer_fsdp_grad_sync" in distributed:
        defer = bool(distributed.pop("defer_fsdp_grad_sync"))
        distributed["fsdp_reduce_every_micro_batch"] = not defer
        said.append(f"distributed.defer_fsdp_grad_sync {str(defer).lower()} -> "
                    f"distributed.fsdp_reduce_every_micro_batch {str(not defer).lower()}")
    if distributed.get("reshard_after_forward", True) is not True:
        refused.append(f"distributed.reshard_after_forward: {distributed['reshard_after_forward']!r}; remat's "
                       "FSDP2 reshards after each block's forward; allowed: true (or remove the key)")
    elif distributed.pop("reshard_after_forward", None) is not None:
        said.append("distributed.reshard_after_forward true: dropped (what remat's FSDP2 does)")
    if distributed.get("strategy") == "megatron_fsdp":
        distributed["strategy"] = "fsdp2"
        said.append("distributed.strategy megatron_fsdp -> fsdp2 (PyTorch's FSDP2: the same sharding of parameters, "
                    "gradients and optimizer state over the data-parallel ranks, the same training; Megatron FSDP's "
                    "own bucketing and overlap are not reproduced, so step times and buffers may differ)")


def _qat(qat: dict[str, Any], said: list[str], refused: list[str]) -> None:
    """NeMo's ``qat`` section: its ``qat_config`` (NeMo's QATConfig over torchao's quantizers) flattened into remat's
    ``qat`` section, which has the same keys (`remat.models.qat`)."""
    config = qat.pop("qat_config", None)
    if isinstance(config, Mapping):
        target = config.get("_target_")
        if target is not None and not str(target).endswith("quantization.qat.QATConfig"):
            refused.append(f"qat.qat_config._target_: {target!r}; allowed: NeMo's QATConfig (quantizer_type, "
                           "groupsize), which remat's qat section reads")
            return
        for key, value in config.items():
            if key != "_target_":
                qat[key] = value
    said.append("qat (NeMo's QATConfig) -> qat: torchao's fake-quantising linear layers (quantizer_type, groupsize, "
                "fake_quant_after_n_steps)" if qat.get("enabled") else "qat: read as it is (not enabled)")


#: NeMo's parallelizers whose work is remat's own FSDP2 of each block (expert parallelism, what NeMo's MoE one adds,
#: is ``distributed.ep_size``: refused above 1 on its own).
_PARALLELIZERS: Final[frozenset[str]] = frozenset({"nemo_automodel.components.moe.parallelizer.parallelize_model"})


def _parallelizer(out: dict[str, Any], said: list[str], refused: list[str]) -> None:
    """NeMo's ``parallelizer`` section: its MoE parallelizer is remat's FSDP2 of each block; its
    ``activation_checkpointing`` the distributed section's."""
    section = out.get("parallelizer")
    if not isinstance(section, dict) or section.get("_target_") not in _PARALLELIZERS:
        return  # another class: refused as NeMo's own with the other leftovers
    out.pop("parallelizer")
    said.append("parallelizer._target_ parallelize_model (NeMo's MoE parallelizer) -> remat's own sharding of each "
                "block (distributed.strategy; expert parallelism is distributed.ep_size, which remat has not above 1)")
    for key in sorted(set(section) - {"_target_", "activation_checkpointing"}):
        refused.append(f"parallelizer.{key}: not an option remat's sharding has; allowed: activation_checkpointing")
    if "activation_checkpointing" in section:
        setting = section["activation_checkpointing"]
        distributed = _section(out, "distributed")
        current = distributed.setdefault("activation_checkpointing", setting)
        if current != setting:
            refused.append(f"parallelizer.activation_checkpointing: {setting!r} contradicts "
                           f"distributed.activation_checkpointing {current!r}; allowed: one of them")
        else:
            said.append(f"parallelizer.activation_checkpointing {str(setting).lower()} -> "
                        "distributed.activation_checkpointing")


def _packing_options(packed: Mapping[str, Any], said: list[str], refused: list[str]) -> None:
    """``packed_sequence``'s keys besides its size: said with what remat's packing does, or refused by name."""
    if packed.get("packing_strategy") not in (None, "thd"):
        refused.append(f"packed_sequence.packing_strategy: {packed['packing_strategy']!r}; remat packs documents "
                       "into rows whose position_ids restart per document (NeMo's thd); allowed: thd")
    elif "packing_strategy" in packed:
        said.append("packed_sequence.packing_strategy thd: what remat's packed rows are (position_ids restart per "
                    "document, documents attend apart)")
    if "split_across_pack" in packed:
        said.append(f"packed_sequence.split_across_pack {packed['split_across_pack']}: remat concatenates documents "
                    "and cuts rows every seq_length tokens; a document cut at a row boundary continues as a segment "
                    "of its own (no document is dropped or padded)")
    if "num_proc" in packed:
        said.append(f"packed_sequence.num_proc {packed['num_proc']}: dropped (remat packs in its own process)")
    if "max_packs" in packed:
        said.append(f"packed_sequence.max_packs {packed['max_packs']}: dropped; remat packs every document it reads "
                    "(dataset.max_samples caps the documents)")
    known = {"packed_sequence_size", "packing_strategy", "split_across_pack", "num_proc", "max_packs"}
    for key in sorted(set(packed) - known):
        refused.append(f"packed_sequence.{key}: not a packing option remat has; allowed: packed_sequence_size, "
                       "packing_strategy (thd), split_across_pack, num_proc, max_packs")


def _checkpoint(out: dict[str, Any], said: list[str], refused: list[str]) -> None:
    section = out.get("checkpoint")
    if not isinstance(section, dict):
        return
    fmt = section.pop("model_save_format", None)
    if fmt not in (None, "safetensors", "torch_save"):
        refused.append(f"checkpoint.model_save_format: {fmt!r}; allowed: safetensors or torch_save (remat writes "
                       "safetensors either way)")
    elif fmt == "torch_save":
        said.append("checkpoint.model_save_format torch_save: remat writes safetensors instead (a transformers "
                    "model/ export that from_pretrained loads; weights, never pickles)")
    elif fmt is not None:
        said.append("checkpoint.model_save_format safetensors: what remat writes")
    if "dequantize_base_checkpoint" in section:
        value = section.pop("dequantize_base_checkpoint")
        if value:
            _section(out, "model")["dequantize"] = True
            said.append("checkpoint.dequantize_base_checkpoint true -> model.dequantize true (a quantised checkpoint, "
                        "FP8 or MXFP4, is dequantised by transformers as it loads; a float one loads as it is)")
        else:
            said.append("checkpoint.dequantize_base_checkpoint false: dropped (remat loads floating-point weights)")
    if "save_consolidated" in section:
        section.pop("save_consolidated")
        said.append("checkpoint.save_consolidated: dropped (every checkpoint has a transformers model/ export)")


def _schedules(out: dict[str, Any], said: list[str], refused: list[str]) -> None:
    sched = out.get("step_scheduler")
    if isinstance(sched, dict) and "num_epochs" in sched:
        epochs = sched["num_epochs"]
        if "max_steps" not in sched:
            said.append(f"step_scheduler.num_epochs {epochs}: the same key (max_steps derived from the dataset's rows "
                        "and the global batch, said when the data is built)")
        else:
            sched.pop("num_epochs")
            said.append(f"step_scheduler.num_epochs {epochs}: dropped (max_steps {sched['max_steps']} ends the run)")
    if isinstance(sched, dict) and "gc_every_steps" in sched:
        every = sched.pop("gc_every_steps")
        said.append(f"step_scheduler.gc_every_steps {every}: dropped (remat leaves Python's garbage collector as it "
                    "is; the training loop holds no reference cycles)")
    lr = out.get("lr_scheduler")
    if not isinstance(lr, dict):
        return
    renames = {"lr_decay_style": "decay", "lr_warmup_steps": "warmup_steps", "lr_decay_steps": "decay_steps"}
    for old, new in renames.items():
        if old in lr:
            lr[new] = lr.pop(old)
            said.append(f"lr_scheduler.{old} -> lr_scheduler.{new}")
    if "min_lr" in lr:
        raw = lr.pop("min_lr")
        min_lr = float(raw) if _positive_number(raw) or raw == 0 else -1.0
        base = (out.get("optimizer") or {}).get("lr")
        if min_lr < 0:
            refused.append(f"lr_scheduler.min_lr: got {raw!r}; allowed: a number >= 0")
        elif not isinstance(base, (int, float)) or base <= 0:
            refused.append(f"lr_scheduler.min_lr: {min_lr:g} needs optimizer.lr to become remat's min_lr_ratio; "
                           "write lr_scheduler.min_lr_ratio")
        else:
            lr["min_lr_ratio"] = min_lr / float(base)
            said.append(f"lr_scheduler.min_lr {min_lr:g} -> lr_scheduler.min_lr_ratio {min_lr / float(base):g}")
    lr.pop("_target_", None)


def _peft(out: dict[str, Any], said: list[str], refused: list[str]) -> None:
    peft = out.get("peft")
    if not isinstance(peft, dict) or "_target_" not in peft:
        return
    peft.pop("_target_")
    for old, new in (("dim", "r"), ("alpha", "lora_alpha"), ("dropout", "lora_dropout")):
        if old in peft:
            peft[new] = peft.pop(old)
    if peft.pop("match_all_linear", False):
        peft["target_modules"] = "all-linear"
    for key in ("target_modules", "exclude_modules"):
        patterns = peft.get(key)
        if isinstance(patterns, str) and patterns != "all-linear":
            patterns = [patterns]
        if isinstance(patterns, list) and any(any(c in str(p) for c in "*?[") for p in patterns):
            peft[key] = "|".join(fnmatch.translate(str(p)) for p in patterns)  # PEFT: a string is one regex
            said.append(f"peft.{key} {patterns} (wildcards) -> the regular expression {peft[key]!r} over whole "
                        "module names")
    if not peft.get("exclude_modules"):
        peft.pop("exclude_modules", None)
    init = peft.pop("lora_A_init", "xavier")  # NeMo's defaults: NOTE [ NeMo's LoRA on PEFT's adapters ]
    peft["lora_a_init"] = "xavier_normal" if init == "xavier" else "kaiming_uniform"
    position = peft.pop("dropout_position", "post")
    if position not in ("pre", "post"):
        refused.append(f"peft.dropout_position: {position!r}; allowed: pre, post")
    peft["dropout_position"] = position
    dropped = [key for key in ("use_triton",) if peft.pop(key, None) is not None]
    said.append("peft (NeMo's PeftConfig) -> peft: LoRA through the peft library (dim -> r, alpha -> lora_alpha, "
                f"dropout -> lora_dropout), started and dropped out as NeMo's LoRA (lora_a_init {peft['lora_a_init']}, "
                f"dropout_position {position})" + (f"; {', '.join(dropped)} dropped (NeMo's kernels)"
                                                   if dropped else ""))


# ------------------------------------------------------------------------------------------------ helpers

def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _section(out: dict[str, Any], key: str) -> dict[str, Any]:
    section = out.get(key)
    if not isinstance(section, dict):
        section = out[key] = {}
    return section


def _targets(data: Any) -> list[Any]:
    return [target for _, target in _targets_with_keys(data)]


def _targets_with_keys(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = []
    if isinstance(data, Mapping):
        for key, value in data.items():
            dotted = f"{prefix}{key}"
            if key == "_target_":
                found.append((dotted, value))
            else:
                found += _targets_with_keys(value, dotted + ".")
    return found
