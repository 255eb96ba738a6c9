"""``remat finetune RECIPE [--nproc-per-node N ...] [--dotted.key VALUE ...]``: validate a recipe and train, in this
process or in worker processes started by torchrun."""

from __future__ import annotations

import argparse
import logging
import os
import types
from typing import Any

from pydantic import BaseModel

NAME = "finetune"

logger = logging.getLogger(__name__)

DESCRIPTION = """\
Fine-tune a causal LM from a YAML recipe. Any recipe key can be overridden on the command line with its dotted
name, e.g.:
  remat finetune examples/quickstart.yaml --step_scheduler.max_steps 10
  remat finetune examples/quickstart.yaml --distributed.activation_checkpointing=selective
  remat finetune examples/quickstart.yaml --distributed.activation_checkpointing '{mode: full, every_n_layers: 2}'
Values are read as YAML (true, 3e-4, [a, b], {k: v}). The recipe is validated before anything is built.

Several processes (distributed.strategy ddp or fsdp2) are started through torchrun:
  remat finetune examples/fsdp2_quickstart.yaml --nproc-per-node 2
  remat finetune recipe.yaml --nproc-per-node 8 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500
A recipe already running under torchrun (torchrun ... -m remat.cli finetune recipe.yaml) is not launched again.
"""


def register(subparsers: Any) -> None:
    from remat.distributed.launch import add_launch_arguments
    from remat.recipes.config import RecipeConfig

    parser = subparsers.add_parser(
        NAME, help="fine-tune a causal LM from a YAML recipe", description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="recipe keys (dotted name, type, default):\n" + "\n".join(schema_lines(RecipeConfig)),
    )
    parser.add_argument("recipe", help="path of the YAML recipe (see examples/ and docs/recipes.md)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the validated recipe with every default filled in, then exit")
    parser.add_argument("--restart", action="store_true",
                        help="start over at step 0: move the checkpoints already in checkpoint_dir into "
                             "checkpoint_dir/.superseded-<time>/ (nothing is deleted); same as "
                             "--checkpoint.resume restart. For one invocation: a requeued job must not repeat it")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let the model's own Python files run (transformers' trust_remote_code, for a model "
                             "directory or Hub repository whose config.json has an auto_map); a recipe file alone "
                             "cannot switch this on. Same as --model.trust_remote_code true")
    add_launch_arguments(parser)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    """``remat finetune``: prepare the recipe (read, check, validate, plan once), then either start the workers
    (`_launch`, under ``--nproc-per-node``) or train in this process (`_train_here`: one process, or a worker)."""
    prepared = _prepare(args, overrides)
    if isinstance(prepared, int):  # --print-config: printed
        return prepared
    options, overrides, cfg = prepared
    from remat.distributed.launch import check_launch_environment

    if check_launch_environment(options):
        return _launch(args, options, overrides, cfg)
    return _train_here(args, cfg)


def _prepare(args: argparse.Namespace, overrides: list[str]) -> int | tuple[Any, list[str], Any]:
    """The launch options, the overrides the workers get and the validated (and, under ``auto``, planned) recipe;
    or the exit code of ``--print-config``. What can be refused without torch is refused before it loads."""
    from remat.distributed.launch import LaunchOptions
    from remat.recipes.loader import load_recipe_data, validate_recipe

    options = LaunchOptions.from_namespace(args)
    options.check()  # impossible launcher values are refused before anything is read or started
    overrides = restart_overrides(overrides) if args.restart else list(overrides)
    if args.trust_remote_code:  # the workers get it as the override, which the recipe loader accepts
        overrides += ["--model.trust_remote_code", "true"]
    data = load_recipe_data(args.recipe, overrides)  # before torch is imported: a mistake in the recipe is said at once
    _check_before_start(data, options, printing=args.print_config)
    cfg = validate_recipe(data)
    if cfg.distributed.auto is not None:
        cfg = _plan_once(args, options, cfg)
    if args.print_config:
        return _print_config(cfg)
    return options, overrides, cfg


def _plan_once(args: argparse.Namespace, options: Any, cfg: Any) -> Any:
    """The ``auto`` recipe planned once: the launcher (or rank 0) plans and writes the plan file in the run's
    directory, the workers read it (`remat.planner.handoff`)."""
    from remat.distributed.env import under_torchrun
    from remat.planner.handoff import planned_recipe
    from remat.recipes.run_safety.run_lock import refuse_if_held, run_directories

    launcher = options.requested and not under_torchrun()
    writes = not args.print_config and (launcher or os.environ.get("RANK", "0") == "0")
    if writes and not under_torchrun():  # the plan file goes in the run's directories: not while another run
        refuse_if_held(run_directories(cfg))  # holds them (a worker's peers may hold them already: same run)
    world_size = (options.num_processes() if launcher else None) or int(os.environ.get("WORLD_SIZE", "1"))
    return planned_recipe(cfg, world_size=world_size, writes=writes)


def _launch(args: argparse.Namespace, options: Any, overrides: list[str], cfg: Any) -> int:
    """Start the workers through torchrun after what would fail in every one of them is said once here: the layout,
    a run holding the directories, the CUDA devices, the host memory activation offload needs (once per node)."""
    from remat.commands.host_memory import checked_before_launch
    from remat.distributed.env import check_cuda_devices
    from remat.distributed.launch import launch
    from remat.recipes.finetune import check_parallel_layout
    from remat.recipes.run_safety.run_lock import refuse_if_held, run_directories

    options = restarts_for_replanning(options, cfg)
    world_size = options.num_processes()
    if world_size is not None:
        check_parallel_layout(cfg, world_size)
    refuse_if_held(run_directories(cfg))
    nproc = options.nproc_per_node or "1"
    if cfg.distributed.device == "cuda" and nproc.isdigit():
        check_cuda_devices(int(nproc))
    with checked_before_launch(cfg, local_ranks=int(nproc) if nproc.isdigit() else None, world_size=world_size):
        if cfg.checkpoint.enabled and cfg.checkpoint.resume == "restart":
            overrides = restart_before_launch(cfg, options.node_rank, overrides)
        return launch(options, ["-m", "remat.cli", "--log-level", args.log_level, NAME, args.recipe, *overrides])


def _train_here(args: argparse.Namespace, cfg: Any) -> int:
    """Train in this process (the only one, or one of torchrun's workers) and return the run's exit code."""
    from remat.commands.host_memory import check_in_worker
    from remat.distributed.env import ProcessEnv
    from remat.recipes.finetune import FinetuneRecipe
    from remat.recipes.shipped import find_recipe

    process = ProcessEnv.from_environ()
    if process.launched:  # a kill -9 of the launcher must not leave this worker running
        from remat.distributed.launch import stop_with_launcher

        stop_with_launcher()
    if process.rank != 0:  # only rank 0 reports; the others say only what goes wrong
        logging.getLogger("remat").setLevel(logging.WARNING)
    note = single_process_note(cfg.distributed.strategy, process.world_size, args.recipe)
    if note is not None:
        logging.getLogger(__name__).warning(note)
    check_in_worker(cfg, local_ranks=process.local_world_size, world_size=process.world_size)
    replanner = _run_time_replanner(cfg, process.world_size) if cfg.distributed.auto is not None else None
    return _run_recipe(FinetuneRecipe(cfg, replanner=replanner, source=find_recipe(args.recipe)), process)


def _run_recipe(recipe: Any, process: Any) -> int:
    """Run ``recipe``; every rank leaves together, and a rank whose peer died stops with the last complete checkpoint
    kept instead of waiting in a collective."""
    try:
        result = recipe.run()
        # Every rank leaves together: rank 0 may still be drawing the run's report, and gloo's teardown was seen to
        # hang (1 in 20 ddp runs) when one rank destroyed the process group while its peer was still busy.
        recipe.dist.barrier()
    except RuntimeError as err:
        from remat.distributed.exit import exit_now, peer_lost

        if process.world_size == 1 or not peer_lost(err):
            raise
        logger.error("rank %d: another rank's process ended (%s); this one stops too, the last complete checkpoint "
                     "is kept: see that rank's own output for why", process.rank, " ".join(str(err).split())[-120:])
        exit_now(1)
    finally:
        recipe.dist.close()
    if process.world_size > 1:  # a rank could still abort in Python's teardown: see remat.distributed.exit
        from remat.distributed.exit import exit_now

        exit_now(result.exit_code)
    return result.exit_code


def _check_before_start(data: dict[str, Any], options: Any, *, printing: bool = False) -> None:
    """What can be refused without torch (validating a recipe resolves its ``_target_``s, which loads it), refused
    before: missing data paths, and a ``distributed`` section that does not fit the launch (``--nproc-per-node 2`` on
    a ``single`` recipe). Sections that do not validate are left to the recipe's own validation, which names them.
    ``printing`` (``--print-config``, which reads the recipe, not the data, as it reads no Hub dataset either): a
    missing data path is a WARNING line, and the run that would read it refuses it."""
    from pydantic import ValidationError

    from remat.data.config import DatasetConfig
    from remat.data.sources import check_paths_exist
    from remat.distributed.config import DistributedConfig, asks_for_auto
    from remat.errors import ConfigError

    for key in ("dataset", "validation_dataset"):
        try:
            section = DatasetConfig.model_validate(data[key]) if isinstance(data.get(key), dict) else None
        except ValidationError:
            continue
        if section is None:
            continue
        try:
            check_paths_exist(section, key)
        except ConfigError as err:
            if not printing:
                raise
            logger.warning("%s (printed anyway: a run refuses it until it exists)", err)
    world_size = options.num_processes()
    dist = data.get("distributed", {})
    if isinstance(dist, dict) and dist.get("device") == "cpu":
        setting = dist.get("activation_checkpointing")
        if asks_for_auto(setting):
            from remat.checkpointing.budget import parse_budget

            budget = (setting.get("memory_budget") if isinstance(setting, dict) else None) or dist.get("memory_budget")
            if budget is None:  # planning for the CPU needs a budget: said now, not after measuring the blocks
                parse_budget(None, device_bytes=None, key="distributed.activation_checkpointing.memory_budget")
    if options.requested and world_size is not None and "LOCAL_RANK" not in os.environ and isinstance(dist, dict):
        sizes = {name: dist[name] for name in ("strategy", "dp_size", "tp_size", "cp_size") if name in dist}
        DistributedConfig.from_settings(**sizes).data_parallel_size(world_size)


def restarts_for_replanning(options: Any, cfg: Any) -> Any:
    """`options` with ``--max-restarts`` set to ``max_replans`` for an ``auto`` recipe on several processes that did
    not give it: an out-of-memory error on one rank is re-planned after torchrun restarts the workers
    (`remat.adaptation.oom_notes`). Given explicitly (0 included), it is kept."""
    import dataclasses

    auto = cfg.distributed.auto
    processes = options.num_processes()
    if auto is None or options.max_restarts is not None or auto.max_replans == 0 or processes == 1:
        return options
    logger.info("activation checkpointing 'auto' on several processes: --max-restarts %d (max_replans), so that an "
                "out-of-memory error on one rank is re-planned after a restart; give --max-restarts to choose "
                "otherwise", auto.max_replans)
    return dataclasses.replace(options, max_restarts=auto.max_replans)


def _run_time_replanner(cfg: Any, world_size: int) -> Any:
    """The re-planner of an ``auto`` run (`remat.adaptation`), or None with ``max_replans: 0``."""
    if cfg.distributed.auto.max_replans == 0:
        return None
    from remat.adaptation.adapter import adapter_for_recipe

    return adapter_for_recipe(cfg, world_size=world_size)


def _print_config(cfg: Any) -> int:
    import yaml

    print(yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False), end="")
    return 0


def single_process_note(strategy: str, world_size: int, recipe: str) -> str | None:
    """The warning for a ddp / fsdp2 recipe started as one process (allowed: it runs, but shards nothing)."""
    if strategy == "single" or world_size > 1:
        return None
    return (f"distributed.strategy is {strategy!r} but this is one process, so nothing is sharded or replicated; "
            f"to use several: remat finetune {recipe} --nproc-per-node N (or strategy 'single' to silence this)")


def restart_overrides(overrides: list[str]) -> list[str]:
    """`overrides` with ``checkpoint.resume`` set to ``restart`` (what ``--restart`` means); ConfigError when they
    already set ``checkpoint.resume`` to something else."""
    from remat.errors import ConfigError
    from remat.recipes.loader import parse_overrides

    given = [value for key, value in parse_overrides(overrides) if key == "checkpoint.resume"]
    if given and given[-1] != "restart":
        raise ConfigError(f"--restart: conflicts with --checkpoint.resume {given[-1]}; give one of them")
    return [*overrides, "--checkpoint.resume", "restart"]


def restart_before_launch(cfg: Any, node_rank: int | None, overrides: list[str]) -> list[str]:
    """Move the checkpoints aside once, here in the launcher (node 0), and let the workers resume ``auto``: workers
    that torchrun restarts after a failure (``--max-restarts``) then continue from the new checkpoints instead of
    moving them aside again."""
    from remat.recipes.finetune import checkpoint_directory
    from remat.training_state.verify import supersede_checkpoints

    if not node_rank:
        supersede_checkpoints(checkpoint_directory(cfg))
    return [*overrides, "--checkpoint.resume", "auto"]


def schema_lines(model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per recipe key: dotted name, type and default (read from the pydantic schema)."""
    lines = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name)
        nested = _nested_model(info.annotation)
        if nested is not None:
            optional = not info.is_required() and info.default is None
            lines.append(f"  {key}:" + ("  (optional section)" if optional else ""))
            lines.extend(schema_lines(nested, key + "."))
            continue
        default = "required" if info.is_required() else f"default {_show(info.get_default(call_default_factory=True))}"
        lines.append(f"  {key}  [{type_label(info.annotation)}]  {default}")
        auto = _models_in(info.annotation)
        if auto:  # activation_checkpointing: the planner's keys, read with mode auto
            lines.extend(f"{line}  (with auto)" for line in schema_lines(auto[0], key + ".")
                         if not line.split()[0].endswith((".mode", ".plan")))
        if model.model_config.get("extra") == "allow" and name == "target":
            lines.append(f"  {prefix}<argument>  other keys are keyword arguments of the _target_")
    return lines


def type_label(annotation: Any) -> str:
    """A recipe key's type as a person reads it: ``int > 0 or null``, ``one of cosine | linear | constant``."""
    from typing import Annotated, Literal, Union, get_args, get_origin

    from remat.checkpointing.policy import POLICY_STRINGS, CheckpointPolicy

    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is CheckpointPolicy:
        return f"true | false | {' | '.join(POLICY_STRINGS)} | a mapping (see docs/recipes.md)"
    if getattr(annotation, "__name__", "") == "MemoryBudget":
        return "bytes | a size such as 40GiB | a fraction of the device's memory in (0, 1] | null: the device's less 10%"
    if _models_in(annotation):  # the policy or auto
        return f"true | false | {' | '.join(POLICY_STRINGS)} | auto | a mapping (see docs/recipes.md)"
    if origin is Literal:
        return "one of " + " | ".join(str(a).lower() if isinstance(a, bool) else str(a) for a in args)
    if origin is Annotated:
        bounds = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
        limits = [f"{sign} {getattr(meta, name)}" for meta in args[1:] for name, sign in bounds.items()
                  if getattr(meta, name, None) is not None]
        return " ".join([type_label(args[0]), *limits])
    if origin in (Union, types.UnionType):
        kept = [type_label(a) for a in args if a is not type(None)]
        return " or ".join(kept) + (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {type_label(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _show(default: Any) -> str:
    if default is None or isinstance(default, bool):  # as YAML writes them
        return {None: "null", True: "true", False: "false"}[default]
    to_value = getattr(default, "to_value", None)
    if callable(to_value):  # a MemoryBudget
        return _show(to_value())
    to_dict = getattr(default, "to_dict", None)
    if callable(to_dict):  # a CheckpointPolicy: the spelling a recipe would use
        value = to_dict()
        return repr(value.get("mode", value) if len(value) == 1 else value)
    return repr(default)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models inside a union of a model with other types (``activation_checkpointing``: auto or a policy)."""
    from typing import get_args

    args = get_args(annotation)
    if not args:
        return []
    found = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    return found + [m for a in args if not isinstance(a, type) for m in _models_in(a)]


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None
