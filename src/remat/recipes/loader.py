"""Load a recipe: YAML file + command-line overrides -> a validated ``RecipeConfig``, or one clear ``ConfigError``.

Overrides use dotted keys: ``--step_scheduler.max_steps 10`` or ``--distributed.activation_checkpointing=selective``.
Values are parsed as YAML scalars/flow collections, so ``true``, ``3e-4``, ``[1, 2]`` and ``{mode: full}`` work.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from remat._files import read_regular_bytes, shown
from remat._logs import warn_once
from remat._validation import format_validation_error, model_of
from remat.errors import ConfigError
from remat.loss.contract import loss_input
from remat.recipes.config import LossConfig, RecipeConfig, TargetConfig
from remat.recipes.nemo import from_nemo, is_nemo_recipe
from remat.recipes.shipped import find_recipe
from remat.recipes.targets import PROVIDED_ARGS, SECTION_KINDS, check_kwargs, resolve_target


logger = logging.getLogger(__name__)


class RecipeYamlLoader(yaml.SafeLoader):
    """Safe YAML loading that also reads ``3e-4`` and ``1e5`` as floats (YAML 1.1 leaves them strings) and refuses
    a key given twice in one mapping (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if not isinstance(key, Hashable):
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be text or a number, not a {type(key).__name__}", key_node.start_mark)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (first at line {seen[key] + 1})", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


RecipeYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

# Keys only the person running a recipe may set (a command-line override or Python), never the recipe file: a shared
# recipe must not widen the ``_target_`` allow-list for itself.
RUNNER_ONLY_KEYS: dict[str, str] = {
    "custom_target_packages": "",
    "allow_custom_targets": " (this older key was a switch; it is now a list of the packages you trust)",
}
#: The command-line spelling of ``model.trust_remote_code: true`` (`remat finetune --trust-remote-code`).
TRUST_REMOTE_CODE = "model.trust_remote_code"


#: How YAML writes "no value": an override of a text key with one of these unsets it.
YAML_NULLS: frozenset[str] = frozenset({"null", "Null", "NULL", "~"})


def parse_overrides(args: Sequence[str], schema: type[BaseModel] | None = None) -> list[tuple[str, Any]]:
    """Turn ``["--a.b", "1", "--c=x"]`` into ``[("a.b", 1), ("c", "x")]``. Values are read as YAML, except that a key
    whose field in ``schema`` holds text only (``output_dir``, a path, a name) keeps the text as written:
    ``--output_dir 20240101`` is the directory "20240101", not a number (``null`` still unsets it)."""
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"override {arg!r}: expected --dotted.key VALUE or --dotted.key=VALUE")
        body = arg[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args) or (args[i + 1].startswith("--") and len(args[i + 1]) > 2):
                raise ConfigError(f"override --{body}: missing value (use --{body} VALUE or --{body}=VALUE)")
            key, raw = body, args[i + 1]
            i += 2
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {arg!r}: malformed key {key!r}")
        as_text = schema is not None and _is_text_field(schema, key.split(".")) and raw.strip() not in YAML_NULLS
        pairs.append((key, raw if as_text else _parse_value(raw)))
    return pairs


def _parse_value(raw: str) -> Any:
    try:
        return yaml.load(raw, Loader=RecipeYamlLoader) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """Set each dotted key in a copy of ``data``, creating intermediate mappings as needed. A policy written as a
    string takes keys as its mapping: ``--distributed.activation_checkpointing.memory_budget 40GiB`` over
    ``activation_checkpointing: auto``."""
    result: dict[str, Any] = _deep_copy(data)
    for key, value in overrides:
        node = result
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif isinstance(child, str) and part == "activation_checkpointing":  # auto (or a mode) gains keys
                child = node[part] = {"mode": child}
            elif not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise ConfigError(f"override --{key}: {prefix!r} is {child!r}, not a section with keys")
            node = child
        node[parts[-1]] = value
    return result


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a recipe file (a path, or the name of a shipped recipe: `remat.recipes.shipped`); errors name the file
    and, for syntax errors, the line. Bounded: a regular file of at most `MAX_RECIPE_BYTES`, whose YAML, aliases
    expanded, has at most `MAX_RECIPE_VALUES` values nested at most `MAX_RECIPE_DEPTH` deep."""
    path = find_recipe(path)
    if path.is_dir():
        raise ConfigError(f"recipe {shown(path)} is not a file (a directory); give the path of a YAML recipe")
    raw = read_regular_bytes(path, "recipe", limit=MAX_RECIPE_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"recipe {shown(path)} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset "
                          f"{err.start}); a recipe is a YAML file") from None
    loader = None
    try:
        loader = RecipeYamlLoader(text)  # its reader refuses control characters here
        node = loader.get_single_node()  # type: ignore[no-untyped-call]
        if node is not None:
            _check_bounds(node, path)
        data = loader.construct_document(node) if node is not None else None  # type: ignore[no-untyped-call]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"recipe {shown(path)} is not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"recipe {shown(path)} nests deeper than YAML can be read; allowed: at most "
                          f"{MAX_RECIPE_DEPTH} levels") from None
    finally:
        if loader is not None:
            loader.dispose()  # type: ignore[no-untyped-call]
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {str(path)!r}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


#: Bounds of a recipe file: a recipe is a few kilobytes of a few hundred values; these leave room for any real one
#: and stop a hostile one (a 50 MB line, an alias "billion laughs", deep nesting) before it costs minutes or memory.
MAX_RECIPE_BYTES = 1024**2
MAX_RECIPE_VALUES = 100_000
MAX_RECIPE_DEPTH = 64


def _check_bounds(root: yaml.Node, path: Path) -> None:
    """ConfigError when the YAML node graph at `root`, aliases expanded, holds more than `MAX_RECIPE_VALUES` values
    or nests deeper than `MAX_RECIPE_DEPTH`, or refers to itself. Counted over the shared graph (each node once,
    iteratively), so the check costs what the file is, not what its aliases would expand to."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
            if size[key] > MAX_RECIPE_VALUES:
                raise ConfigError(f"recipe {shown(path)} expands to more than {MAX_RECIPE_VALUES:,} values (through "
                                  f"its aliases); allowed: at most {MAX_RECIPE_VALUES:,}")
            if depth[key] > MAX_RECIPE_DEPTH:
                raise ConfigError(f"recipe {shown(path)} nests deeper than {MAX_RECIPE_DEPTH} levels (line "
                                  f"{node.start_mark.line + 1}); allowed: at most {MAX_RECIPE_DEPTH}")
            continue
        if key in size:
            continue
        if key in on_path:
            raise ConfigError(f"recipe {shown(path)} has an alias that refers to itself (line "
                              f"{node.start_mark.line + 1}); allowed: aliases of values defined before them")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in size)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def validate_recipe(data: Mapping[str, Any]) -> RecipeConfig:
    """Validate a recipe mapping; every problem is reported with its dotted key."""
    try:
        cfg = RecipeConfig.model_validate(dict(data))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, RecipeConfig)) from None
    _check_targets(cfg)
    _check_cross_section(cfg)
    _check_schedule(cfg)
    return with_model_outputs(cfg)


def load_recipe(path: str | Path, overrides: Sequence[str] | Sequence[tuple[str, Any]] = (), *,
                data_needed: bool = True) -> RecipeConfig:
    """Read ``path``, apply command-line ``overrides`` (raw ``--key value`` strings or parsed pairs) and validate.
    ``data_needed=False``: for a command that reads no data (estimate, plan); a NeMo recipe's dataset builders are then
    set aside instead of refused (`remat.recipes.nemo.from_nemo`)."""
    return validate_recipe(load_recipe_data(path, overrides, data_needed=data_needed))


def load_recipe_data(path: str | Path, overrides: Sequence[str] | Sequence[tuple[str, Any]] = (), *,
                     data_needed: bool = True) -> dict[str, Any]:
    """The recipe mapping of ``path`` with ``overrides`` applied, not yet validated (some mistakes are said from it
    before torch is imported: `remat.commands.finetune`)."""
    data = read_yaml(path)
    pairs = (parse_overrides(overrides, RecipeConfig) if overrides and isinstance(overrides[0], str)  # type: ignore[arg-type]
             else list(overrides))
    if is_nemo_recipe(data):  # NeMo AutoModel's llm_finetune spelling: mapped key by key, or refused with the remat one
        data, said = from_nemo(data, data_needed=data_needed, check=_problems)
        for line in said:
            logger.info("NeMo AutoModel recipe: %s", line)
    _refuse_runner_only_keys(data, path)
    if not any(key == TRUST_REMOTE_CODE for key, _ in pairs):
        _refuse_remote_code(data, path)
    data = apply_overrides(data, pairs)  # type: ignore[arg-type]
    if data.get("output_dir") in (None, ""):  # each recipe file its own run directory (remat.recipes.run_safety.resume_changes)
        data["output_dir"] = f"outputs/{Path(path).stem}"
    return data


def _problems(data: dict[str, Any]) -> list[str]:
    """What `validate_recipe` would refuse in ``data``, one line per problem (none when it validates)."""
    try:
        validate_recipe(data)
    except ConfigError as err:
        lines = str(err).splitlines()
        return [line.strip() for line in (lines[1:] if len(lines) > 1 else lines)]
    return []


def _refuse_runner_only_keys(data: Mapping[str, Any], path: str | Path) -> None:
    for key, note in RUNNER_ONLY_KEYS.items():
        if key in data:
            raise ConfigError(
                f"{key}: set in the recipe file {str(path)!r}; a recipe cannot widen the _target_ allow-list for "
                f"itself, since a shared recipe could then run any code{note}. Remove it, and trust your own "
                "package when you run the recipe: --custom_target_packages '[my_package]'"
            )


def _refuse_remote_code(data: Mapping[str, Any], path: str | Path) -> None:
    """A recipe file alone cannot switch on ``model.trust_remote_code``: in transformers that flag is the caller's
    own opt-in, and a shared recipe pointing at a model directory with a ``modeling_*.py`` would run that file."""
    model = data.get("model")
    if not isinstance(model, Mapping) or model.get("trust_remote_code") in (None, False):
        return
    from remat.models.remote_code import remote_code_files

    source = model.get("pretrained_model_name_or_path")
    files = remote_code_files(source) if isinstance(source, str) else []
    would_run = f"; it would run {', '.join(files)}" if files else ""
    raise ConfigError(
        f"{TRUST_REMOTE_CODE}: set to {model.get('trust_remote_code')!r} in the recipe file {str(path)!r}, which "
        f"cannot switch on code shipped with a model{would_run}. If you trust that code, say so when you run it: "
        "remat finetune RECIPE --trust-remote-code (or --model.trust_remote_code true)"
    )


def _check_targets(cfg: RecipeConfig) -> None:
    for section, kind in SECTION_KINDS.items():
        target_cfg: TargetConfig = getattr(cfg, section)
        fn = resolve_target(target_cfg.target, key=f"{section}._target_", kind=kind,
                            custom_packages=cfg.custom_target_packages)
        check_kwargs(fn, target_cfg.kwargs, key=f"{section}._target_", provided=PROVIDED_ARGS[section])


def with_loss(cfg: RecipeConfig, loss_fn: Mapping[str, Any]) -> RecipeConfig:
    """A copy of ``cfg`` training with the loss section ``loss_fn`` (one remat chose: the planner's
    ``loss: choose``), the model's outputs following it; only the loss section is validated."""
    loss = LossConfig.model_validate(dict(loss_fn))
    loss_class = resolve_target(loss.target, key="loss_fn._target_", kind=SECTION_KINDS["loss_fn"],
                                custom_packages=cfg.custom_target_packages)
    model = cfg.model.model_copy(update={"output_hidden_states": loss_input(loss_class) == "hidden_states"})
    return cfg.model_copy(update={"loss_fn": loss, "model": model})


def with_model_outputs(cfg: RecipeConfig) -> RecipeConfig:
    """The recipe with ``model.output_hidden_states`` derived from what the loss consumes (`remat.loss.loss_input`).

    The key is kept for recipes written before losses declared it: a value that agrees with the loss is accepted, one
    that contradicts it is an error naming both keys."""
    loss_class = resolve_target(cfg.loss_fn.target, key="loss_fn._target_", kind=SECTION_KINDS["loss_fn"],
                                custom_packages=cfg.custom_target_packages)
    consumes = loss_input(loss_class)
    wanted = consumes == "hidden_states"
    if "output_hidden_states" in cfg.model.model_fields_set and cfg.model.output_hidden_states != wanted:
        raise ConfigError(
            f"model.output_hidden_states: {str(cfg.model.output_hidden_states).lower()} contradicts loss_fn._target_ "
            f"{cfg.loss_fn.target!r}, which consumes {consumes}; allowed: {str(wanted).lower()}, or leave the key "
            "out (it follows from the loss)")
    model = cfg.model.model_copy(update={"output_hidden_states": wanted})
    return cfg.model_copy(update={"model": model})


def _warn_once(message: str, *args: Any) -> None:
    warn_once(logger, message, *args)


def _check_cross_section(cfg: RecipeConfig) -> None:
    if cfg.model.quantization is not None:
        _check_quantization(cfg)
    if cfg.qat.enabled:
        for on, key in ((cfg.fp8.enabled, "fp8.enabled"), (cfg.model.quantization is not None, "model.quantization"),
                        (cfg.peft is not None, "peft")):
            if on:
                raise ConfigError(f"qat.enabled with {key}; quantization-aware training fake-quantises the full "
                                  f"weights it trains, in the model's dtype; allowed: one of them")
    if cfg.training.neftune_noise_alpha is not None and cfg.distributed.cp_size > 1:
        raise ConfigError(f"training.neftune_noise_alpha with distributed.cp_size {cfg.distributed.cp_size}: NEFTune "
                          "scales its noise by the row's length, and each context-parallel rank holds a shard of the "
                          "row; allowed: cp_size 1, or no neftune_noise_alpha")
    if cfg.fp8.enabled and not cfg.fp8.emulate and cfg.dataset.seq_length % 16:
        raise ConfigError(f"dataset.seq_length: {cfg.dataset.seq_length} with fp8.enabled; FP8 matrix multiplies take "
                          "dimensions that are multiples of 16; allowed: a multiple of 16 (e.g. "
                          f"{-(-cfg.dataset.seq_length // 16) * 16})")
    if cfg.fp8.enabled and cfg.fp8.enable_fsdp_float8_all_gather and cfg.distributed.strategy != "fsdp2":
        raise ConfigError(f"fp8.enable_fsdp_float8_all_gather: true is how FSDP2 gathers sharded weights, but "
                          f"distributed.strategy is {cfg.distributed.strategy!r}; allowed with it: false")
    if cfg.compile.enabled and cfg.logging.memory == "tracked":
        raise ConfigError("compile.enabled: true with logging.memory: tracked; the tracker sees every op through a "
                          "dispatch mode, under which torch.compile runs the blocks eagerly; allowed: logging.memory: "
                          "auto (rss on the CPU, the CUDA allocator on a GPU), rss or cuda")
    setting = cfg.distributed.activation_checkpointing
    policy = cfg.distributed.auto.plan if cfg.distributed.auto is not None else setting
    tile = getattr(policy, "tile_tokens", None)
    if getattr(policy, "tiled", False) and tile is not None and tile >= cfg.dataset.seq_length:
        _warn_once("distributed.activation_checkpointing.tile_tokens: %d is not less than dataset.seq_length %d, "
                       "so a row is one tile and nothing is tiled; to tile it, lower tile_tokens (e.g. %d)", tile,
                       cfg.dataset.seq_length, max(1, cfg.dataset.seq_length // 4))


def _check_quantization(cfg: RecipeConfig) -> None:
    """QLoRA's rules between sections (`remat.models.quantization`)."""
    if cfg.peft is None:
        raise ConfigError("model.quantization: the 4-bit base weights are frozen, so nothing would train; add a peft "
                          "section (LoRA adapters trained over them: QLoRA), e.g. peft: {r: 16}")
    if cfg.fp8.enabled:
        raise ConfigError("fp8.enabled with model.quantization; the base weights are either 4-bit (bitsandbytes) or "
                          "FP8 (torchao); allowed: one of them")
    if cfg.model.quantization.bnb_4bit_quant_storage == "uint8" and cfg.distributed.strategy == "fsdp2":
        raise ConfigError("model.quantization.bnb_4bit_quant_storage: 'uint8' under distributed.strategy fsdp2, which "
                          "shards floating-point parameters; allowed: float32, bfloat16 or float16 (null: the model's "
                          "dtype)")
    if cfg.distributed.auto is not None:
        raise ConfigError("distributed.activation_checkpointing: auto with model.quantization; the planner and the "
                          "estimate do not model 4-bit weights yet; allowed: a fixed policy (full, selective, "
                          "attention, mlp, every_n, sqrt) or false")


def _check_schedule(cfg: RecipeConfig) -> None:
    sched, warmup = cfg.step_scheduler, cfg.lr_scheduler.warmup_steps
    if warmup > sched.max_steps and not sched.steps_from_epochs:  # a warning: short trial runs are common
        _warn_once("lr_scheduler.warmup_steps (%d) is more than step_scheduler.max_steps (%d): the learning rate "
                       "never reaches optimizer.lr in this run", warmup, sched.max_steps)
    if cfg.validation_dataset is None:
        for key in ("val_every_steps", "val_batches"):
            if getattr(sched, key) is not None:
                raise ConfigError(f"step_scheduler.{key}: set to {getattr(sched, key)}, but the recipe has no "
                                  "validation_dataset section to validate on; add one or remove this key")


# ----------------------------------------------------------------------------------------------------------------
# Validation error formatting


def _is_text_field(root: type[BaseModel], parts: list[str]) -> bool:
    """Whether the field at the dotted path ``parts`` accepts text only (str or a path, maybe None; no numbers)."""
    model: Any = root
    for part in parts[:-1]:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return False
        model = model_of(fields[part].annotation)
    info = getattr(model, "model_fields", {}).get(parts[-1])
    if info is None:
        return False
    annotation = info.annotation
    if get_origin(annotation) in (Union, UnionType):  # str | None, Optional[Path]
        kinds = {arg for arg in get_args(annotation) if arg is not type(None)}
    else:  # list[str], dict[...] and the like are not text
        kinds = {annotation} if get_origin(annotation) is None else {list}
    return bool(kinds) and kinds <= {str, Path}
