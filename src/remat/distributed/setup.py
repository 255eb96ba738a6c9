"""``DistributedSetup``: how the model is spread over processes, and the order in which memory savers are applied.

Strategies:
- ``single``: one process, one device;
- ``ddp``: every rank holds the whole model; gradients are all-reduced (``DistributedDataParallel``);
- ``fsdp2``: parameters, gradients and optimizer state are sharded over the data-parallel ranks (``fully_shard``
  per transformer block, per segment for segment checkpointing, and at the root), optionally with tensor
  parallelism inside the blocks (``tp_size``).

With ``cp_size`` > 1 (``ddp`` or ``fsdp2``) each sequence is also cut over the ranks of a context-parallel group
(`remat.distributed.context_parallel`): the mesh is ``(dp, cp)``, the ranks of a group read the same batch, and DDP /
FSDP2 run over all ``dp x cp`` ranks (each holds a share of the global batch: its rows' shard of tokens).

``parallelize`` applies, in this order: activation checkpointing (it wraps the transformer blocks), tensor
parallelism, ``fully_shard`` per block then at the root (FSDP2), or the DDP wrapper. Processes are started by
torchrun (``remat finetune RECIPE --nproc-per-node N``); ``build`` joins the process group from its environment
(NCCL on CUDA, gloo on the CPU) and lays the ranks out on a device mesh ``(dp, tp)`` or ``(dp, cp)``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from remat.checkpointing.policy import CheckpointPolicy, PolicyLike
from remat.checkpointing import (
    CheckpointPlan,
    apply_activation_checkpointing,
    parse_policy,
    remove_activation_checkpointing,
)
from remat.checkpointing.discovery import find_blocks, is_moe_block
from remat.checkpointing.plan import planned_policy
from remat.distributed import context_parallel
from remat.distributed.choices import Strategy
from remat.distributed.context_parallel import ContextShards
from remat.distributed.choices import DEVICE_CHOICES
from remat.distributed.config import DistributedConfig
from remat.distributed.env import ProcessEnv, init_process_group, resolve_device
from remat.distributed.rendezvous import INIT_TIMEOUT_S, WATCHDOG_GRACE_S, setup_deadline, setup_failure
from remat.errors import CheckpointingError, ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)



@dataclass
class DistributedSetup:
    """The parallelism of a run: ``setup = DistributedSetup.build(...)``, then ``model = setup.parallelize(model)``.

    ``dp_size`` x ``tp_size`` x ``cp_size`` = ``world_size``; ranks are laid out ``(dp, tp)``, ``(dp, cp)`` or
    ``(dp, cp, tp)`` with the tensor- and context-parallel ranks of a data-parallel replica adjacent (on the same node
    when the node holds that many ranks or more).
    """

    strategy: Strategy = "single"
    activation_checkpointing: PolicyLike = False
    dp_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    mixed_precision: str | None = None
    cpu_offload: bool = False
    fsdp_reduce_every_micro_batch: bool = True
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    mesh: DeviceMesh | None = None
    """The device mesh with dimensions ``("dp",)``, ``("dp", "tp")``, ``("dp", "cp")`` or ``("dp", "cp", "tp")``; None
    for ``single``."""
    batch_mesh: DeviceMesh | None = None
    """The one-dimensional mesh of the ranks that each hold a share of the batch (``dp``, or ``dp x cp`` flattened):
    DDP and FSDP2 run over it; None for ``single``."""
    context: ContextShards | None = None
    """This rank's context-parallel group (``cp_size`` > 1), which cuts each batch's rows; None otherwise."""
    plan: CheckpointPlan | None = None
    root: nn.Module | None = None
    """The module ``parallelize`` returned (the DDP wrapper, or the FSDP2 root)."""
    owns_process_group: bool = False
    planned: bool = False
    """``activation_checkpointing`` is the planner's choice (``auto``): the planner gave its own notes, so the generic
    advice on selective for MoE blocks is not repeated when the plan is applied."""

    @classmethod
    def build(
        cls,
        strategy: Strategy = "single",
        activation_checkpointing: PolicyLike = False,
        dp_size: int | None = None,
        tp_size: int = 1,
        cp_size: int = 1,
        mixed_precision: str | None = None,
        cpu_offload: bool = False,
        *,
        fsdp_reduce_every_micro_batch: bool = True,
        device: str | torch.device | None = "auto",
        init_timeout_s: float = INIT_TIMEOUT_S,
        timeout_s: float | None = None,
    ) -> DistributedSetup:
        """`from_config` with the keys of a recipe's ``distributed`` section as keyword arguments (each documented
        on `DistributedConfig`), validated as a recipe's are; ``device`` may also be a ``torch.device`` or
        ``"cuda:N"``. ``activation_checkpointing`` is a policy (``auto`` is planned by `remat.planner` first)."""
        named = device if device in DEVICE_CHOICES else "auto"
        config = DistributedConfig.from_settings(
            strategy=strategy, activation_checkpointing=activation_checkpointing, dp_size=dp_size, tp_size=tp_size,
            cp_size=cp_size, mixed_precision=mixed_precision, cpu_offload=cpu_offload,
            fsdp_reduce_every_micro_batch=fsdp_reduce_every_micro_batch, device=named,
            init_timeout_s=init_timeout_s, timeout_s=timeout_s)
        return cls.from_config(config, device=device)

    @classmethod
    def from_config(cls, config: DistributedConfig, *, device: str | torch.device | None = None) -> DistributedSetup:
        """Check ``config`` (a validated ``distributed`` section) against the launch (torchrun's ``WORLD_SIZE``),
        join the process group (NCCL on CUDA, gloo on the CPU; within ``init_timeout_s``, else a
        `DistributedSetupError` naming the ranks) and lay out the device mesh. ``device`` overrides
        ``config.device`` (e.g. ``torch.device("cuda", 1)``). A policy ``auto`` planned is applied without the
        generic advice the planner already gave in its notes."""
        env = ProcessEnv.from_environ()
        setup = cls.of_config(config, dp_size=config.data_parallel_size(env.world_size), world_size=env.world_size,
                              device=resolve_device(config.device if device is None else device, env))
        setup.rank, setup.local_rank = env.rank, env.local_rank
        if config.strategy != "single":
            setup._join(env, config.init_timeout_s, config.timeout_s)
        return setup

    @classmethod
    def of_config(cls, config: DistributedConfig, *, dp_size: int, world_size: int,
                  device: torch.device) -> DistributedSetup:
        """The setup ``config`` describes on ``world_size`` processes, before any process group is joined (the
        memory estimate's simulated rank fills in its own mesh)."""
        return cls(strategy=config.strategy, activation_checkpointing=config.policy, planned=config.auto is not None,
                   dp_size=dp_size, tp_size=config.tp_size, cp_size=config.cp_size,
                   mixed_precision=config.mixed_precision, cpu_offload=config.cpu_offload,
                   fsdp_reduce_every_micro_batch=config.fsdp_reduce_every_micro_batch, world_size=world_size,
                   device=device)

    def _join(self, env: ProcessEnv, init_timeout_s: float, timeout_s: float | None) -> None:
        """Join the process group and build the mesh, within ``init_timeout_s`` (a watchdog past it)."""
        late = setup_failure(env.rank, env.world_size, init_timeout_s, "still waiting (setup watchdog)")
        with setup_deadline(init_timeout_s + WATCHDOG_GRACE_S, late):
            self.owns_process_group = init_process_group(env, self.device, init_timeout_s=init_timeout_s,
                                                         timeout_s=timeout_s)
            self.mesh = device_mesh(self.device, self.dp_size, self.tp_size, self.cp_size)
            self.batch_mesh = self.mesh["dp"]
            if self.cp_size > 1:
                # One dimension over dp x cp for DDP and FSDP2 (as TorchTitan's `dp_shard_cp`); made on every rank.
                self.batch_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")
                cp = self.mesh["cp"]
                self.context = ContextShards(cp.get_group(), self.cp_size, int(cp.get_local_rank()))

    # ------------------------------------------------------------------------------------------------ layout

    @property
    def is_main_process(self) -> bool:
        """Rank 0: the process that prints, writes metrics and publishes checkpoints."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """Whether a process group is in use (``ddp`` / ``fsdp2``, even with one rank)."""
        return self.mesh is not None

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas (which shard of each global batch it reads)."""
        return int(self.mesh["dp"].get_local_rank()) if self.mesh is not None else 0

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The process group of the data-parallel ranks (None for ``single``)."""
        return self.mesh["dp"].get_group() if self.mesh is not None else None

    @property
    def shard_count(self) -> int:
        """The ranks that each hold their own share of a step's batch, ``dp_size x cp_size``: DDP and FSDP2 average
        gradients over them."""
        return self.dp_size * self.cp_size


    def describe(self) -> str:
        """One line for the run log, e.g. ``fsdp2 over 4 processes (dp 2 x tp 2), backend gloo, device cpu``."""
        if not self.is_distributed:
            return f"single process on {self.device}"
        layout = (f"dp {self.dp_size}" + (f" x cp {self.cp_size}" if self.cp_size > 1 else "")
                  + (f" x tp {self.tp_size}" if self.tp_size > 1 else ""))
        extras = [f"mixed precision {self.mixed_precision}"] if self.mixed_precision else []
        extras += ["cpu offload"] if self.cpu_offload else []
        return (f"{self.strategy} over {self.world_size} process{'es' if self.world_size > 1 else ''} ({layout}), "
                f"backend {dist.get_backend()}, device {self.device.type}" + "".join(f", {e}" for e in extras))

    # ------------------------------------------------------------------------------------------------ model

    def parallelize(self, model: nn.Module, *, root: nn.Module | None = None,
                    after_checkpointing: Callable[[nn.Module, CheckpointPolicy], None] | None = None) -> nn.Module:
        """Apply activation checkpointing (recorded in ``self.plan``), tensor parallelism, then the strategy's
        wrapper; returns the module a training step calls.

        ``root`` is an optional module that contains ``model`` and whose forward the training step calls instead
        (for example one that runs the decoder and the loss together, see ``remat.recipes.model_loss``): FSDP2 then
        gathers the parameters outside the blocks (embeddings, final norm, output head) around *its* forward, and
        DDP synchronises gradients of whatever it uses. Without it, ``model`` is the root.
        ``after_checkpointing(model, policy)`` runs between checkpointing and the wrapper (the recipe's per-block
        ``torch.compile``).
        """
        top = root if root is not None else model
        if root is not None and not any(m is model for m in root.modules()):
            raise ValueError("parallelize: `root` must contain `model` as a submodule")
        if any(t.device != self.device for t in (*model.parameters(), *model.buffers())):
            model.to(self.device)  # skipped when already there: `Module.to` cannot run on fake parameters
        policy = parse_policy(self.activation_checkpointing, key="distributed.activation_checkpointing")
        if self.context is not None:
            name = context_parallel.enable(model, self.context, tp_size=self.tp_size)
            logger.info("context parallel: %s, each row cut over %d ranks", name, self.cp_size)
        with planned_policy(self.planned):
            self.plan = apply_activation_checkpointing(model, policy)
        if after_checkpointing is not None:
            after_checkpointing(model, policy)
        if self.strategy == "single":
            self.root = top
        elif self.strategy == "ddp":
            self.root = self._wrap_ddp(model, top)
        else:
            self.root = self._shard_fsdp2(model, top, policy.block_pattern)
        return self.root

    def replace_checkpointing(self, model: nn.Module, policy: Any) -> CheckpointPlan:
        """Swap the activation checkpointing `parallelize` applied to ``model`` for ``policy``, in place (unwrap
        every block, wrap again; parameters, gradients, optimizer state and the DDP / FSDP2 wrappers are untouched),
        between steps. Under fsdp2 the new plan must shard the blocks in the same units (no multi-block segments
        appearing or vanishing): `CheckpointingError` otherwise."""
        parsed = parse_policy(policy, key="distributed.activation_checkpointing")
        old_groups = self._groups_of(self.plan, model)
        remove_activation_checkpointing(model)
        with planned_policy(self.planned):
            self.plan = apply_activation_checkpointing(model, parsed)
        self.activation_checkpointing = parsed
        if self.strategy == "fsdp2" and self._groups_of(self.plan, model) != old_groups:
            raise CheckpointingError(
                f"fsdp2: the policy {parsed.describe()} groups blocks into other FSDP units than the one it "
                "replaces (multi-block segments); it cannot be swapped in while training. Pin a policy without "
                "segments, or restart the run with it")
        return self.plan

    def _groups_of(self, plan: CheckpointPlan | None, model: nn.Module) -> tuple[tuple[str, ...], ...]:
        if plan is not None and plan.layers:
            return plan.shard_groups()
        try:
            return tuple((block.name,) for block in find_blocks(model).blocks)
        except CheckpointingError:
            return ()

    def _blocks(self, model: nn.Module, block_pattern: str | None) -> list[nn.Module]:
        try:
            return [block.module for block in find_blocks(model, block_pattern).blocks]
        except CheckpointingError as err:
            if self.tp_size > 1:
                raise ConfigError(f"distributed.tp_size: {self.tp_size} needs the model's transformer blocks, but "
                                  f"none were found: {err}") from err
            logger.warning("fsdp2: no transformer blocks found (%s); the whole model is one FSDP unit", err)
            return []

    def _shard_fsdp2(self, model: nn.Module, top: nn.Module, block_pattern: str | None) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        blocks = self._blocks(model, block_pattern)
        if self.tp_size > 1:
            from remat.distributed.tensor_parallel import apply_tensor_parallel

            split = apply_tensor_parallel(_text_config(model), blocks, self.mesh["tp"])
            logger.info("tensor parallel: %d linear layers split over %d ranks", split, self.tp_size)
        options: dict[str, Any] = {"mesh": self.batch_mesh}
        if self.mixed_precision is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, self.mixed_precision),
                                                        reduce_dtype=torch.float32)
        options["offload_policy"] = (CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if self.cpu_offload
                                     else OffloadPolicy())
        units = self._shard_units(model, blocks)
        for index, unit in enumerate(units):
            # The last unit's parameters are needed again at once by backward: keep them gathered.
            fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=index < len(units) - 1, **options)
        fully_shard(top, **options)
        return top

    def _shard_units(self, model: nn.Module, blocks: list[nn.Module]) -> list[list[nn.Module]]:
        """The groups of blocks sharded as one FSDP2 unit each: the plan's ``shard_groups()`` (a checkpointed
        segment is replayed as a whole in backward, so its blocks are gathered together), one block per unit when
        nothing was checkpointed."""
        if self.plan is None or not self.plan.layers:
            return [[block] for block in blocks]
        modules = dict(model.named_modules())
        return [[modules[name] for name in group] for group in self.plan.shard_groups()]

    def _wrap_ddp(self, model: nn.Module, top: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        try:
            moe = any(block.is_moe for block in find_blocks(model).blocks)
        except CheckpointingError:
            moe = is_moe_block(model)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        mesh = self.batch_mesh
        assert mesh is not None, "ddp has a mesh"
        # Routed experts that receive no token in a step get no gradient: DDP must then look for unused ones.
        return DistributedDataParallel(top, device_ids=device_ids, process_group=mesh.get_group(),
                                       find_unused_parameters=moe)

    # ------------------------------------------------------------------------------------------------ training

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        """Around forward+backward of a micro-batch: ``enabled=False`` skips the gradient synchronisation (all
        micro-batches of a step but the last), so gradients accumulate locally first (DDP ``no_sync``; FSDP2
        ``set_requires_gradient_sync`` when ``fsdp_reduce_every_micro_batch`` is False)."""
        root = self.root
        if enabled or root is None or self.strategy == "single":
            yield
            return
        if self.strategy == "ddp":
            with root.no_sync():  # type: ignore[operator]
                yield
            return
        if self.fsdp_reduce_every_micro_batch:
            yield
            return
        root.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)  # type: ignore[operator]

    def reshard(self) -> None:
        """Free the gathered parameters FSDP2 kept after a forward without backward (evaluation): the root and the
        last block keep theirs after forward, expecting backward to follow. No-op for other strategies."""
        if self.strategy != "fsdp2" or self.root is None:
            return
        from torch.distributed.fsdp import FSDPModule

        for module in self.root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def sum_over_dp(self, values: list[float]) -> list[float]:
        """Element-wise sums of ``values`` over the data-parallel ranks (unchanged for ``single``); float64. For what
        every rank of a context-parallel group counts alike (the label tokens of its rows)."""
        return self._sum(values, self.dp_group)

    def sum_over_shards(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ``dp x cp`` ranks: for what each rank holds its own share of (the loss of its
        rows' shard of tokens); the same as `sum_over_dp` without context parallelism."""
        mesh = self.batch_mesh
        return self._sum(values, mesh.get_group() if mesh is not None else None)

    def _sum(self, values: list[float], group: dist.ProcessGroup | None) -> list[float]:
        if not self.is_distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor.tolist()

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on at least one (e.g. a stop request seen by one process)."""
        if not self.is_distributed:
            return flag
        tensor = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    @contextlib.contextmanager
    def local_main_first(self) -> Iterator[None]:
        """Run the block on each node's local rank 0 first (filling caches such as the tokenizer's), then on the
        other ranks, which then read what it wrote."""
        if not self.is_distributed:
            yield
            return
        if self.local_rank != 0:
            dist.barrier()
        yield
        if self.local_rank == 0:
            dist.barrier()

    def barrier(self) -> None:
        """Wait for every rank (no-op for ``single``)."""
        if self.is_distributed:
            dist.barrier()

    def close(self) -> None:
        """Leave the process group if ``build`` created it."""
        if self.context is not None:
            context_parallel.disable()
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_process_group = False


def device_mesh(device: torch.device, dp: int, tp: int, cp: int = 1) -> DeviceMesh:
    """The ranks laid out ``(dp,)``, ``(dp, cp)``, ``(dp, tp)`` or ``(dp, cp, tp)`` over the default process group
    (the real one, or the estimate's fake one: `remat.estimate.simulate`)."""
    from torch.distributed.device_mesh import init_device_mesh

    if cp > 1 and tp > 1:  # tensor-parallel ranks innermost: the most traffic between the nearest ranks
        return init_device_mesh(device.type, (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    if cp > 1:
        return init_device_mesh(device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    if tp > 1:
        return init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device.type, (dp,), mesh_dim_names=("dp",))


def _text_config(model: nn.Module) -> Any:
    from remat.checkpointing.discovery import find_decoder

    config = getattr(find_decoder(model), "config", None) or getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config
