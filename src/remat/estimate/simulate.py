"""Simulate one training step on fake tensors and record every allocation it makes.

`simulate_step` runs the recipe's own build (`remat.recipes.build`: model, checkpointing, loss module, data-parallel
wrapper, optimizer) under ``FakeTensorMode`` (shapes and dtypes, no storage; over a fake process group for
``fsdp2``) and the recipe's own step (`remat.recipes.step.train_step`: forward and backward of the micro-batches,
gradient clipping, the optimizer step, whose state is created here, and ``zero_grad``), all inside a
`LiveTensorTracker` whose listener records each allocation, free, resize and change of category. The recorded `StepTrace` is what `remat.estimate.api` replays through an allocator model.

Details that make the fake step the real one:

- The batch (``input_ids``, ``labels``, ``position_ids``) is made of *real* integer tensors, and ops whose tensor
  arguments are all real run for real (`_SimulationMode`): the losses count label tokens and select rows by value,
  and transformers decides from the values of ``position_ids`` / ``attention_mask`` whether it must build a mask.
  Ops mixing real and fake tensors run fake. For ``target="cuda"`` the batch's own bytes are counted (the recipe
  moves it to the device); on the CPU they are not (the loader's tensors, as in the recipe's tracked ``mem``).
- ``target="cuda"`` models a CUDA GPU: attention runs the kernel CUDA would pick, with its backward workspaces
  (`remat.estimate.attention`; counts include recomputations), and optimizers that accept ``foreach`` get ``foreach=True`` unless the
  caller chose (PyTorch's default for CUDA parameters; on CPU parameters it runs a per-parameter loop).
  ``target="cpu"`` runs what the CPU runs, so the figures equal a real CPU step's tracked peak.
- A recipe's ``peft`` section is applied by the recipe's own `apply_lora`, its adapters made on the meta device and
  then given fake storage (`remat.estimate.fake_model`: peft's ``Module.to`` cannot swap fake parameters).
- DTensor's sharding propagation builds global-shape tensors to infer output shapes; on real tensors it does so in
  a private fake mode, which the simulation gives it here too, so those never count.
- ``ddp``: ``DistributedDataParallel`` needs real parameter data at construction, so it cannot wrap fake tensors.
  The step is simulated without the wrapper (every rank runs the whole model on its micro-batch, as in DDP), and the
  reducer's gradient buckets are added from the start of the step: DDP keeps one flat buffer per bucket (the first of
  1 MiB, the others of 25 MiB, filled in reverse parameter order as `dist._compute_bucket_assignment_by_size` does)
  for the whole run, next to the ``.grad`` tensors (``gradient_as_bucket_view=False``, the default).
- ``cp_size`` > 1: the step of the first rank of a context-parallel group, over a fake process group of the whole
  ``dp x cp`` launch: its shard of each row, the all-to-all buffers of every attention call (their meta kernels give
  the shapes) and full-sequence attention for ``heads / cp_size`` heads. The ranks of a group differ only in which
  of their tokens carry a label (the fused loss keeps a row index per label token), a few bytes.
- Offloading policies run the recipe's own `remat.checkpointing.offload.OffloadActivations` hooks
  (`remat.estimate.offload`): its host copies are counted as host memory (``StepTrace.host_peak``), not in the
  device figures.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch._ops import HigherOrderOperator
from torch import Tensor
from torch import nn
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, unset_fake_temporarily)
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from remat._logs import quiet_log
from remat.data import IGNORE_INDEX
from remat.distributed import DistributedSetup
from remat.distributed.setup import device_mesh
from remat.distributed.layout import world_layout
from remat.errors import ConfigError
from remat.estimate.choices import TARGETS, Target
from remat.estimate.compiled import (EAGER_FALLBACK_NOTE, CompiledRegionTracker, SimulatedCompile,
                                     compile_failure_note, compile_simulated_blocks, compiled_blocks_notes,
                                     simulated_compile, simulated_recompile_limit)
from remat.estimate.attention import (CPU_ATTENTION_OP, CUDA_ATTENTION_KERNELS, KERNEL_OPS, CudaAttention,
                                      backward_workspace)
from remat.estimate.fake_model import build_fake_model
from remat.estimate.limits import check_simulated_sizes
from remat.estimate.offload import count_offload_on_host, describe_offload
from remat.estimate.run import SimulatedRun
from remat.memory.tracker import LiveTensorTracker
from remat.models.build import resolve_model_config
from remat.recipes.build import build_optimizer, build_training_module
from remat.recipes.config import RecipeConfig
from remat.recipes.step import UPDATE_PHASE, step_label_tokens, train_step

DDP_BUCKET_BYTES: Final[int] = 25 * 2**20
"""DistributedDataParallel's default bucket capacity (the first bucket is ``dist._DEFAULT_FIRST_BUCKET_BYTES``)."""
GRADIENT_BUCKETS: Final[str] = "gradient_buckets"
"""The category of DDP's gradient buckets, which the live-tensor tracker does not see."""
LIBRARY_WORKSPACES: Final[str] = "library_workspaces"
"""The category of the cuBLAS workspaces torch keeps for the whole run (`cublas_workspace_bytes`), which the tracker
does not see."""
MATMUL_THREADS: Final[int] = 2
"""Threads that run matrix products in a step, each with a cuBLAS handle and workspace of its own: the training
loop's (forward and loss) and the autograd engine's device thread (backward, and the recompute of checkpointed
blocks)."""
_DEVICE_OP: Final[Any] = torch.ops.prim.device.default
_WAIT_TENSOR: Final[Any] = torch.ops._c10d_functional.wait_tensor.default
BLOCK_FORWARD: Final[str] = "block forward "
BLOCK_BACKWARD: Final[str] = "block backward "
AFTER_FORWARD: Final[str] = "after block forward "
AFTER_BACKWARD: Final[str] = "after block backward "


class BlockLayout(NamedTuple):
    """What one block got, as far as its allocations go (`block_layout`): blocks with equal layouts record equal
    events."""

    mode: str
    wrapped: tuple[str, ...]
    offload: bool
    segment: tuple[int, int] | None
    tiled: tuple[str, ...]
    tiled_norms: int
    tile_tokens: int | None

    @property
    def spans_blocks(self) -> bool:
        """Recomputed together with other blocks (a segment of several)."""
        return self.segment is not None and self.segment[0] != self.segment[1]


@dataclass(frozen=True)
class StorageEvent:
    """One change the tracker counted (see `remat.memory.tracker.StorageListener`)."""

    kind: str
    serial: int
    nbytes: int
    category: str


@dataclass
class StepTrace:
    """What one simulated step allocated, in order, with the phase marks between the events."""

    recipe: RecipeConfig
    run: SimulatedRun
    events: list[StorageEvent] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)
    """(number of events recorded before the mark, label)."""
    boundaries: list[tuple[int, str]] = field(default_factory=list)
    """The phase marks and, with ``blocks=True``, where each block's forward and backward start (``BLOCK_FORWARD``,
    ``BLOCK_BACKWARD`` + index), in the order they happened: the segments `remat.estimate.compose` reuses."""
    layers: tuple[BlockLayout, ...] = ()
    """What each block got (`block_layout`), with ``blocks=True``."""
    partial: bool = False
    """The simulation stopped where the optimizer update starts (``stop_at_update``): not a whole step."""
    blocks: Any = field(default=None, repr=False)
    """The model's `BlockSearch` (fake modules), with ``blocks=True``: other policies are resolved over it."""
    block_inputs: dict[int, set[int]] = field(default_factory=dict)
    """Block index -> serials of the storages its forward was given (arguments and keyword arguments), with
    ``blocks=True``: besides what it allocates, all a block can hold."""
    host_peak: int = 0
    """The most bytes of offloaded activations held in host memory at once (0 without offloading)."""
    parameters: int = 0
    trainable_parameters: int = 0
    attention_kernels: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def listener(self, kind: str, serial: int, nbytes: int, category: str) -> None:
        """The tracker's listener: appends one event."""
        self.events.append(StorageEvent(kind, serial, nbytes, category))

    def mark(self, label: str) -> None:
        """Start phase ``label`` at the current event."""
        self.marks.append((len(self.events), label))
        self.boundaries.append((len(self.events), label))

    def boundary(self, label: str) -> None:
        """A segment boundary that is not a phase (a block's forward or backward starts)."""
        self.boundaries.append((len(self.events), label))


class _SimulationMode(TorchDispatchMode):
    """Entered above the live-tensor tracker: runs ops whose tensor arguments are all real (the integer batch and
    what is computed from it) for real, outside the fake mode, so that value-dependent code works (label counts, row
    selection, mask decisions); and, when modelling CUDA, allocates the attention backward kernels' workspaces
    around their ops so that the tracker counts them."""

    # A simulated compiled block's graphs run under it (NOTE [ Compiled blocks on fake tensors ]), with the
    # higher-order ops inductor's partition leaves in them (``run_and_save_rng_state``): passed down as they are.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, cuda: bool, balanced_routing: bool = False) -> None:
        super().__init__()
        self.cuda = cuda
        self.balanced_routing = balanced_routing
        self.cpu_attention_calls = 0
        self.attention_kernels: dict[str, int] = {}
        """Forward calls per CUDA attention kernel (`KERNEL_OPS`), recomputations included."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if isinstance(func, HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if func is _DEVICE_OP and isinstance(args[0], FakeTensor) and not args[0].fake_mode.in_kernel_invocation:
            # Half the ops of a step are device queries (the autograd engine asks for every gradient); answered
            # here as the fake mode answers them, they skip the modes below, which neither allocate nor record.
            return args[0].fake_device
        if func is _WAIT_TENSOR and isinstance(args[0], FakeTensor):
            # NOTE [ wait_tensor returns its input ]
            # Eager ``wait_tensor`` waits for a functional collective (context parallelism's all-to-all, DTensor's
            # all-reduce under tensor parallelism) and returns the same tensor; the fake kernel returns a new one.
            # Selective checkpointing saves the outputs of both ops, which eager holds once: the fake copy would
            # count every collective's output twice for each layer (measured: 2 MiB over on tiny-llama, tp 2).
            return args[0]
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor: let it run its ops on local tensors, which come back here
        if _all_real(args, kwargs):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func is _INDEX and any(_real_mask(index) for index in args[1]):
            # A fake tensor selected by a real boolean mask (the labelled positions, from the real batch): the
            # positions are known, so the result's shape is too (fake tensors cannot count a mask's true values).
            args = (args[0], _mask_positions(args[1]))
        if self.balanced_routing and func is _TOPK and isinstance(args[0], FakeTensor):
            return _balanced_topk(*args, **kwargs)
        if self.balanced_routing and func is _ZEROS and _small_integer(args[0], kwargs.get("dtype")):
            with unset_fake_temporarily():  # one_hot's buffer: the routing mask stays real
                return func(*args, **kwargs)
        if not self.cuda:
            if func is _GROUPED_MM and args[0].dtype != torch.bfloat16:
                return _grouped_mm_output(*args, **kwargs)
            return func(*args, **kwargs)
        if func is CPU_ATTENTION_OP:
            self.cpu_attention_calls += 1
        elif func in KERNEL_OPS:
            self.attention_kernels[KERNEL_OPS[func]] = self.attention_kernels.get(KERNEL_OPS[func], 0) + 1
        workspace = backward_workspace(func, args)
        try:
            return func(*args, **kwargs)
        finally:
            del workspace


_TOPK: Final[Any] = torch.ops.aten.topk.default
_INDEX: Final[Any] = torch.ops.aten.index.Tensor


def _real_mask(index: Tensor | None) -> bool:
    return index is not None and index.dtype == torch.bool and not isinstance(index, FakeTensor)


def _mask_positions(indices: list[Tensor | None]) -> list[Tensor | None]:
    """``aten.index``'s indices with each real boolean mask replaced by the positions of its true values, one index
    tensor per masked dimension (what indexing by a mask means)."""
    positions: list[Tensor | None] = []
    for index in indices:
        if _real_mask(index):
            with unset_fake_temporarily():
                positions.extend(index.nonzero(as_tuple=True))  # type: ignore[union-attr]
        else:
            positions.append(index)
    return positions
DATA_DEPENDENT_ERRORS: Final[tuple[type[Exception], ...]] = (DynamicOutputShapeException, DataDependentOutputException)
"""What fake tensors raise for an op whose output depends on values they do not have (`with_routing_fallback`)."""
_ZEROS: Final[Any] = torch.ops.aten.zeros.default
_REAL_MASK_ELEMENTS: Final[int] = 1 << 24  # integer buffers up to this size are made for real under balanced routing


def _small_integer(size: Any, dtype: torch.dtype | None) -> bool:
    """An integer or boolean buffer of at most `_REAL_MASK_ELEMENTS` elements (a routing mask, not an activation)."""
    return (dtype is not None and (dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex))
            and math.prod(size) <= _REAL_MASK_ELEMENTS)


def _balanced_topk(scores: Tensor, k: int, dim: int = -1, largest: bool = True,
                   sorted: bool = True) -> tuple[Tensor, Tensor]:  # noqa: A002 (aten's name)
    """``topk`` of fake ``scores`` with real indices: row ``r`` picks ``r * k + j (mod n)`` for ``j < k``, so every
    one of the ``n`` candidates is picked equally often (see the NOTE in `simulate_step`); the values are the fake
    scores gathered there."""
    dim = dim % scores.dim()
    n = scores.shape[dim]
    shape = [*scores.shape[:dim], *scores.shape[dim + 1:], k]
    with unset_fake_temporarily():
        indices = torch.arange(math.prod(shape), dtype=torch.int64).remainder_(n).view(shape)
        if dim != scores.dim() - 1:
            indices = indices.movedim(-1, dim).contiguous()
    return torch.gather(scores, dim, indices), indices


_GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)
_GROUPED_MM = _GROUPED_MM.default if _GROUPED_MM is not None else None


def _grouped_mm_output(mat_a: Tensor, mat_b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> Tensor:
    """The output of ``torch._grouped_mm`` (MoE experts) for float32 and float16 inputs on the CPU.

    # NOTE [ A shape rule for float experts ]
    # The CPU kernel of ``_grouped_mm`` takes every float dtype, but the shape function fake tensors run (torch
    # 2.11-2.13) asserts bfloat16, so a float32 MoE model could be trained and not estimated or planned. Its output
    # is one new tensor whose shape follows the four cases of 2-d and 3-d operands; allocating that tensor here (the
    # tracker counts it) is all the simulation needs. bfloat16 and CUDA still go through torch's own rule.
    """
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        assert offs is not None
        size = [offs.size(0), mat_a.size(0), mat_b.size(1)]
    elif mat_a.dim() == 2:
        size = [mat_a.size(0), mat_b.size(-1)]
    elif mat_b.dim() == 2:
        size = [mat_a.size(1), mat_b.size(1)]
    else:
        size = [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]
    return torch.empty(size, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


def simulation_mode(target: Target, *, balanced_routing: bool = False) -> TorchDispatchMode:
    """The dispatch mode the simulated step runs under for ``target`` (enter it inside the fake mode, above any
    tracker): real integer inputs stay real, and on ``"cuda"`` attention backward workspaces are allocated. The
    planner (`remat.planner.measure`) runs single blocks under it, as the step runs them. ``balanced_routing``: see
    `with_routing_fallback`."""
    return _SimulationMode(cuda=target == "cuda", balanced_routing=balanced_routing)


_Result = TypeVar("_Result")


def with_routing_fallback(recipe: RecipeConfig, simulate: Callable[[bool], _Result]) -> tuple[_Result, bool]:
    """``simulate(balanced_routing)``'s result, and whether it needed balanced routing: ``simulate(False)`` first and,
    when the model's ops depend on values fake tensors do not have, ``simulate(True)``; a model that still does is
    refused in one line (`ConfigError`). The estimate's step and the planner's block measurement go through here,
    so they answer, and refuse, the same models.

    # NOTE [ Expert routing the fake tensors cannot decide ]
    # Some mixture-of-experts layers (longcat_flash, dbrx, jetmoe in transformers) loop over the experts a router
    # chose: ``nonzero`` / ``where`` on the routing mask and ``.item()``, whose output shapes depend on values fake
    # tensors do not have. When the step fails that way, it is simulated again with the routers' ``topk`` answering
    # real indices, every expert given the same number of tokens (what load balancing aims for), so the loop runs on
    # real integers and sizes each expert's batch. A real router's imbalance adds to its busiest experts'
    # activations; the estimate says so in a note. Models whose experts run on fixed shapes (grouped_mm) never take
    # this path."""
    try:
        return simulate(False), False
    except DATA_DEPENDENT_ERRORS:
        pass
    try:
        return simulate(True), True
    except DATA_DEPENDENT_ERRORS as err:
        raise ConfigError(f"model: {recipe.model.describe()} runs {getattr(err, 'func', 'an op')} on values fake "
                          "tensors do not have, even with any expert routing balanced, so the estimate cannot simulate "
                          "it; allowed: models whose every op has fixed output shapes") from err


def _all_real(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True when the arguments hold at least one tensor and no fake one (lists of tensors included)."""
    found = False
    for arg in (*args, *kwargs.values()):
        for item in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(item, torch.Tensor):
                if isinstance(item, FakeTensor):
                    return False
                found = True
    return found


def with_cuda_loss_defaults(recipe: RecipeConfig) -> RecipeConfig:
    """The recipe as its loss runs on a GPU: `FusedLinearCrossEntropy` with ``compile`` unset takes the compiled fast
    path there (Triton present, as in every CUDA build of torch with its default dependencies), so the simulation,
    whose fake tensors live on the CPU, asks for that path explicitly. It allocates what the compiled kernel does
    (`remat.loss.compiled.CompiledChunkMath` never compiles on fake tensors). TRL's fused LM head
    (`remat.loss.trl_head.TRLFusedLMHead`) takes its GPU path likewise (``device_kernels``)."""
    loss = recipe.loss_fn
    knob = CUDA_LOSS_KNOBS.get(loss.target)
    if knob is None or knob in loss.kwargs:
        return recipe
    fields = loss.model_dump(by_alias=True)
    return recipe.model_copy(update={"loss_fn": type(loss).model_validate({**fields, knob: True})})


#: The loss classes whose GPU path differs from their CPU path, and the keyword that asks for the GPU path.
CUDA_LOSS_KNOBS: Final[dict[str, str]] = {"remat.loss.FusedLinearCrossEntropy": "compile",
                                          "remat.loss.trl_head.TRLFusedLMHead": "device_kernels"}


def simulate_step(recipe: RecipeConfig, run: SimulatedRun, *, blocks: bool = False,
                  stop_at_update: bool = False) -> StepTrace:
    """Run one training step of ``recipe`` on fake tensors, through the recipe's own build
    (`remat.recipes.build`) and step (`remat.recipes.step.train_step`), and return its allocation trace.
    ``blocks`` also records where each block's forward and backward start and end, and what each block got (the
    planner composes other policies' traces from these, `remat.estimate.compose`); ``stop_at_update`` ends the
    simulation where the optimizer update starts (a ``partial`` trace, whose blocks a composition can use: the update
    does not depend on the policy). Models whose expert routing depends on the data are simulated with balanced
    routing (`with_routing_fallback`), and the trace says so in a note."""
    trace, balanced = with_routing_fallback(
        recipe, lambda balanced_routing: _simulate_eager_if_uncompiled(recipe, run, blocks, stop_at_update,
                                                                       balanced_routing))
    if balanced:
        trace.notes.append(ROUTING_NOTE)
    return trace


ROUTING_NOTE: Final[str] = (
    "expert routing depends on the data in this model: simulated with every expert given the same number of tokens "
    "(a real router's imbalance adds to its busiest experts' activations)")


def _simulate_eager_if_uncompiled(recipe: RecipeConfig, run: SimulatedRun, blocks: bool, stop_at_update: bool,
                                  balanced_routing: bool) -> StepTrace:
    """The step, with its blocks compiled as the recipe says; simulated again with eager blocks, said in a note,
    when dynamo ran them eagerly or the compiled blocks could not run on fake tensors (NOTE [ Compiled blocks on
    fake tensors ])."""
    compiled = simulated_compile(recipe.compile)
    try:
        trace = _simulate_step(recipe, run, blocks, stop_at_update, balanced_routing, compiled)
    except (*DATA_DEPENDENT_ERRORS, ConfigError, _StopBeforeUpdate):
        raise
    except Exception as err:
        if compiled is None or compiled.graphs == 0:
            raise
        note = compile_failure_note(err)
    else:
        if compiled is None or compiled.runs > 0:
            return trace
        note = EAGER_FALLBACK_NOTE  # and leave out what its failed attempts kept referenced in this process
    eager = recipe.model_copy(update={"compile": recipe.compile.model_copy(update={"enabled": False})})
    trace = _simulate_step(eager, run, blocks, stop_at_update, balanced_routing, None)
    trace.notes.append(note)
    return trace


def _simulate_step(recipe: RecipeConfig, run: SimulatedRun, blocks: bool, stop_at_update: bool,
                   balanced_routing: bool, compiled: SimulatedCompile | None) -> StepTrace:
    accumulation = check_simulable(recipe, run)
    if run.target == "cuda":
        recipe = with_cuda_loss_defaults(recipe)
    trace = StepTrace(recipe, run)
    start = time.perf_counter()
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    strategy = recipe.distributed.strategy
    cp_size = recipe.distributed.cp_size
    with _process_group(strategy, run.world_size, cp_size), _private_sharding_fake_mode():
        setup = simulation_setup(recipe, run.world_size, mesh=_mesh(recipe, run.world_size))
        net = build_fake_model(recipe, fake, vocab_size=run.vocab_size)
        # FSDP2 over a tensor-parallel mesh builds a joined mesh from its real rank tensor: real ops stay real.
        with fake, _SimulationMode(cuda=False), quiet_log("remat.distributed.setup"):  # (the cp line is the run's)
            root = build_training_module(net, recipe, setup, block_compiler=compiled and partial(
                compile_simulated_blocks, settings=recipe.compile, backend=compiled))
        if setup.plan is not None:
            trace.notes.append(f"activation checkpointing: {setup.plan.summary()}")
        params = list(net.parameters())
        trace.parameters = sum(_local_numel(p) for p in params)
        trainable = [p for p in params if p.requires_grad]
        trace.trainable_parameters = sum(_local_numel(p) for p in trainable)
        batch = make_batch(recipe, run, int(net.config.get_text_config().vocab_size))
        # Real integers, outside the fake mode; every micro-batch is the same batch, so one is counted.
        label_tokens = step_label_tokens([batch], setup) * accumulation
        if run.target == "cuda":
            _add_cublas_workspaces(trace)
        if strategy == "ddp":
            _add_ddp_buckets(trace, trainable)
        with fake:
            optimizer = build_optimizer(recipe, trainable, foreach=True if run.target == "cuda" else None)
        attention = CudaAttention() if run.target == "cuda" else contextlib.nullcontext()
        # A loss whose GPU path the simulation stubs in keeps it for the backward too (NOTE [ TRL's backward runs
        # after the call ] in remat/loss/trl_head.py).
        scope = getattr(getattr(root, "loss_fn", None), "device_kernel_scope", contextlib.nullcontext)
        mode = _SimulationMode(cuda=run.target == "cuda", balanced_routing=balanced_routing)
        parts = root.decoder if root.use_hidden_states else net
        hooks = [parts.register_forward_hook(lambda *_: trace.mark("loss"))]
        tracker = (CompiledRegionTracker if compiled else LiveTensorTracker)(
            module=root, optimizer=optimizer, listener=trace.listener)
        if blocks:
            hooks += _record_blocks(trace, net, recipe, setup, tracker)
        offload = count_offload_on_host(setup.plan, tracker, run)

        def mark(label: str) -> None:
            if stop_at_update and label == UPDATE_PHASE:
                raise _StopBeforeUpdate
            trace.mark(label)
            tracker.mark(label)

        try:
            with fake, attention, scope(), tracker, mode, simulated_recompile_limit():
                # On a GPU the recipe moves the step's micro-batches to the device before the step: they count. On
                # the CPU they are the loader's tensors, which the tracker does not count. Two micro-batches give the
                # peak of any number (the third and later ones repeat the second), so only those two are real
                # copies; the others are fake tensors of the same shapes (counted, never allocated).
                on_device = _device_copies(batch, accumulation if run.target == "cuda" else 0)
                micro_batches = on_device or [batch] * min(accumulation, 2)
                train_step(root, params, optimizer, micro_batches[:2], setup=setup, label_tokens=label_tokens,
                           autocast_dtype=recipe.model.autocast, max_norm=recipe.clip_grad_norm.max_norm, mark=mark)
                del on_device, micro_batches
        except _StopBeforeUpdate:
            trace.partial = True
        except RuntimeError as err:
            if isinstance(err, DATA_DEPENDENT_ERRORS):
                raise
            if "Expected inputs of BF16 type" in str(err):  # torch._grouped_mm's CUDA shape function (MoE experts)
                raise ConfigError(f"dtype: {recipe.model.dtype!r} cannot be simulated for {recipe.model.describe()} "
                                  "on CUDA: its experts run torch._grouped_mm, whose CUDA kernel and shape function "
                                  "take bfloat16 inputs only; allowed: dtype bfloat16 (or target cpu)") from err
            raise
        finally:
            for hook in hooks:
                hook.remove()
    trace.host_peak = tracker.host_peak_bytes
    trace.notes += compiled_blocks_notes(recipe.compile, compiled)
    if offload is not None:
        trace.notes.append(describe_offload(offload, tracker.host_peak_bytes))
    if isinstance(attention, CudaAttention):
        calls = {**mode.attention_kernels, "math": attention.math_calls}
        trace.attention_kernels = {k: calls[k] for k in CUDA_ATTENTION_KERNELS if calls.get(k)}
    if mode.cpu_attention_calls:
        trace.notes.append(f"{mode.cpu_attention_calls} attention calls bypassed the CUDA kernel model (the model "
                           "calls SDPA under another name) and were simulated with the CPU kernel")
    trace.seconds = time.perf_counter() - start
    return trace


class _StopBeforeUpdate(Exception):
    """Raised by the phase mark of a ``stop_at_update`` simulation."""


def block_layout(layer: Any) -> BlockLayout:
    """What a block got (a `LayerPlan`, or None for a block the policy left alone), as far as its allocations go:
    its mode, what is wrapped, offloading, tiling and the blocks recomputed with it."""
    if layer is None:
        return BlockLayout("none", (), False, None, (), 0, None)
    return BlockLayout(layer.mode, layer.wrapped, layer.offload, layer.segment, layer.tiled, layer.tiled_norms,
                       layer.tile_tokens)


def _record_blocks(trace: StepTrace, net: nn.Module, recipe: RecipeConfig, setup: DistributedSetup,
                   tracker: LiveTensorTracker) -> list[Any]:
    """Hooks that record a boundary where each block's forward starts (before FSDP2 gathers its parameters) and ends
    (after FSDP2 frees them), and where its backward starts (when the gradient of its output arrives, before FSDP2's
    own hook on it) and ends (when the gradient of its input is made, after FSDP2's reduce-scatter): the code between
    blocks (the decoder's loop, the embedding, the loss) falls outside the blocks' segments. Also fills
    ``trace.layers``, ``trace.blocks`` and ``trace.block_inputs``. Recomputation inside backward records nothing."""
    from remat.checkpointing.discovery import find_blocks

    policy = recipe.distributed.policy
    search = find_blocks(net, policy.block_pattern if policy is not None else None)
    applied = {layer.index: layer for layer in setup.plan.layers} if setup.plan is not None else {}
    trace.blocks = search
    trace.layers = tuple(block_layout(applied.get(block.index)) for block in search.blocks)

    def in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    outputs: dict[str, weakref.ref[Tensor]] = {}  # the last block's output (the next block's input)

    def forward_starts(index: int) -> Any:
        def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
            if in_backward():
                return
            trace.boundary(f"{BLOCK_FORWARD}{index}")
            inputs = trace.block_inputs.setdefault(index, set())
            for value in (*args, *kwargs.values()):
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(item, Tensor):
                        inputs.update(tracker.serials_of(item))
            hidden = args[0] if args else kwargs.get("hidden_states")
            # its gradient: this block's backward is done (when it is another block's output, that block's
            # backward starts there instead)
            last = outputs.get("last")
            if isinstance(hidden, Tensor) and hidden.requires_grad and (last is None or hidden is not last()):
                hidden.register_hook(lambda _grad: trace.boundary(f"{AFTER_BACKWARD}{index}"))
        return hook

    def backward_starts(index: int) -> Any:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            tensor = output[0] if isinstance(output, (tuple, list)) else output
            if not in_backward() and isinstance(tensor, Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda _grad: trace.boundary(f"{BLOCK_BACKWARD}{index}"))
                outputs["last"] = weakref.ref(tensor)  # a reference would keep it alive
        return hook

    def forward_ends(index: int) -> Any:
        def hook(_module: nn.Module, _args: Any, _output: Any) -> None:
            if not in_backward():
                trace.boundary(f"{AFTER_FORWARD}{index}")
        return hook

    handles = []
    for block in search.blocks:
        module = block.module
        handles.append(module.register_forward_pre_hook(forward_starts(block.index), prepend=True, with_kwargs=True))
        handles.append(module.register_forward_hook(backward_starts(block.index), prepend=True))
        handles.append(module.register_forward_hook(forward_ends(block.index)))  # after FSDP2's post-forward
    return handles


def check_simulable(recipe: RecipeConfig, run: SimulatedRun) -> int:
    """Raise `ConfigError` naming the key when ``recipe`` on ``run`` is something the estimate does not model;
    return the gradient-accumulation steps. The ``distributed`` section is checked by its own validator
    (`remat.distributed.layout.world_layout`) against ``run.world_size``."""
    if run.target not in TARGETS:
        raise ConfigError(f"target: got {run.target!r}; allowed: {', '.join(TARGETS)}")
    d = recipe.distributed
    world_layout(d.strategy, d.dp_size, d.tp_size, d.cp_size, world_size=run.world_size)
    if d.cpu_offload:
        raise ConfigError("distributed.cpu_offload: true keeps FSDP2's state in host memory, which the estimate does "
                          "not model; allowed: false")
    seq_length = recipe.dataset.seq_length
    if not 1 <= run.documents_per_row <= seq_length // 2:
        raise ConfigError(f"documents_per_row: {run.documents_per_row} documents do not fit a row of {seq_length} "
                          f"tokens; allowed: 1 to {seq_length // 2}")
    sched = recipe.step_scheduler
    accumulation = sched.accumulation_steps(run.world_size // (d.cp_size * d.tp_size), run.world_size)
    text_config = resolve_model_config(recipe.model).get_text_config()  # the layers (the vocabulary is not needed)
    check_simulated_sizes(batch_size=sched.local_batch_size, seq_length=seq_length, grad_accumulation=accumulation,
                          world_size=run.world_size, num_layers=getattr(text_config, "num_hidden_layers", None))
    return accumulation


def simulation_setup(recipe: RecipeConfig, world_size: int, *, mesh: Any = None,
                     device: torch.device | None = None) -> DistributedSetup:
    """The recipe's `DistributedSetup` for one rank of ``world_size``, without joining a process group: FSDP2 runs
    over ``mesh`` (a fake process group's); DDP is simulated without its wrapper (see the module docstring); with
    ``cp_size`` > 1 the rank is the first of its context-parallel group, over the mesh's ``cp`` dimension; with
    ``tp_size`` > 1 the first of its tensor-parallel group, over the mesh's ``tp`` dimension."""
    d = recipe.distributed
    setup = DistributedSetup.of_config(d, dp_size=world_size // (d.cp_size * d.tp_size), world_size=world_size,
                                       device=device or torch.device("cpu"))
    setup.strategy = "single" if d.strategy == "ddp" else d.strategy
    if d.cp_size > 1 and mesh is not None:
        from remat.distributed.context_parallel import ContextShards

        setup.context = ContextShards(mesh["cp"].get_group(), d.cp_size, 0)
        setup.mesh, setup.batch_mesh = (mesh, mesh["dp", "cp"]._flatten("dp_cp")) if d.strategy == "fsdp2" else (
            None, None)
    elif mesh is not None:
        setup.mesh, setup.batch_mesh = mesh, mesh["dp"]
    return setup


def make_batch(recipe: RecipeConfig, run: SimulatedRun, vocab_size: int) -> dict[str, torch.Tensor]:
    """The micro-batch the simulation trains on, as real integer tensors: random token ids, ``documents_per_row``
    documents per row (``position_ids`` restart at each), every token a target except each document's first."""
    generator = torch.Generator().manual_seed(0)
    seq_length = recipe.dataset.seq_length
    shape = (recipe.step_scheduler.local_batch_size, seq_length)
    input_ids = torch.randint(0, vocab_size, shape, generator=generator)
    document = -(-seq_length // run.documents_per_row)
    position_ids = (torch.arange(seq_length) % document).expand(shape).clone()
    labels = input_ids.clone()
    labels[position_ids == 0] = IGNORE_INDEX  # a document's first token is never predicted from the one before
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def _device_copies(batch: dict[str, torch.Tensor], copies: int) -> list[dict[str, torch.Tensor]]:
    """``copies`` device copies of ``batch`` (called inside the simulation's modes): the first two are real clones,
    on which value-dependent code runs; the rest are fake tensors of the same shapes and dtypes, which the tracker
    counts as it counts the real ones."""
    real = [{k: v.clone() for k, v in batch.items()} for _ in range(min(copies, 2))]
    return real + [{k: torch.empty(v.shape, dtype=v.dtype) for k, v in batch.items()} for _ in range(copies - 2)]


def cublas_workspace_bytes() -> int:
    """Bytes of the workspace torch gives each cuBLAS handle (one per thread and stream), from the caching allocator
    and kept for the run.

    # NOTE [ cuBLAS workspaces are allocated memory ]
    # torch allocates a cuBLAS workspace through its caching allocator the first time a thread runs a matrix product
    # on a stream, and keeps it: ``max_memory_allocated`` counts it, the tracker sees no tensor. A training step
    # multiplies matrices on two threads (the loop's and the autograd engine's device thread), so two workspaces are
    # alive in every step after the first. Their size is ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KIB:COUNT`` pairs)
    # when set, else torch's default: 32 MiB (``:4096:8``) on compute capability 9.0 (H100, H200), 8 MiB + 128 KiB
    # (``:4096:2:16:8``) on others. Measured on an H200 (torch 2.11): every estimate was 64 MiB under
    # ``max_memory_allocated`` (12.02 GiB measured for 11.96 predicted) until these were counted. Without a GPU in
    # this process the default of compute capability 9.0 is assumed, the most common training GPU.
    """
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
    pairs = re.findall(r":(\d+):(\d+)", config)
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    return 4096 * 1024 * 8 if tuple(capability) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8


def _add_cublas_workspaces(trace: StepTrace) -> None:
    """Record the step's cuBLAS workspaces (NOTE [ cuBLAS workspaces are allocated memory ]) as allocations made
    before the step (serials below DDP's buckets')."""
    nbytes = cublas_workspace_bytes()
    for index in range(MATMUL_THREADS):
        trace.events.insert(index, StorageEvent("alloc", -(1 << 40) - index, nbytes, LIBRARY_WORKSPACES))


def _add_ddp_buckets(trace: StepTrace, trainable: list[nn.Parameter]) -> None:
    """Record DDP's gradient buckets as allocations made before the step (serials below zero: the tracker's are
    positive)."""
    params = list(reversed(trainable))
    buckets, _ = dist._compute_bucket_assignment_by_size(
        params, [dist._DEFAULT_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES], [False] * len(params))
    sizes = [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in buckets]
    for index, nbytes in enumerate(sizes):
        trace.events.append(StorageEvent("alloc", -1 - index, nbytes, GRADIENT_BUCKETS))
    trace.notes.append(f"ddp: gradients are all-reduced through {len(sizes)} buckets ({sum(sizes) / 2**30:.2f} GiB) "
                       "held for the whole run")


def _mesh(recipe: RecipeConfig, world_size: int) -> Any:
    """The device mesh the recipe's ranks are laid out on (`remat.distributed.setup.device_mesh`: FSDP2's ``dp``,
    with ``cp`` and ``tp`` dimensions when they are > 1) over the fake process group, or None for DDP without
    context parallelism (simulated unwrapped); built outside the fake mode (it reads its rank tensor)."""
    d = recipe.distributed
    if d.strategy != "fsdp2" and d.cp_size == 1:
        return None
    return device_mesh(torch.device("cpu"), world_size // (d.cp_size * d.tp_size), d.tp_size, d.cp_size)


def _local_numel(tensor: torch.Tensor) -> int:
    local = getattr(tensor, "_local_tensor", None)
    return int(local.numel() if local is not None else tensor.numel())


@contextlib.contextmanager
def _process_group(strategy: str, world_size: int, cp_size: int = 1) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks (this process is rank 0) for FSDP2 and context parallelism."""
    if strategy != "fsdp2" and cp_size == 1:
        yield
        return
    if dist.is_initialized():
        raise ConfigError(f"distributed.strategy: simulating {strategy!r} needs its own (fake) process group, but this "
                          "process already joined one; allowed inside a distributed job: remat.estimate_memory or "
                          "remat.plan_activation_checkpointing, which run it in a child process "
                          "(remat._child), or a Planner built outside the job")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_fake_meshes()


def _forget_fake_meshes() -> None:
    """Empty DTensor's sharding caches after a simulation. They key on the device mesh, and meshes compare equal by
    shape, names and device type, not by this process's rank: a real FSDP2 run of the same shape later in this
    process (a worker that planned ``auto`` itself, a notebook) would otherwise get DTensors on the fake mesh, where
    every process is rank 0, and its sharded checkpoints fail to save ("Failed to validate global plan")."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()


@contextlib.contextmanager
def _private_sharding_fake_mode() -> Iterator[None]:
    """DTensor infers output shapes by running ops on global-shape fake tensors, in the active fake mode if there is
    one. Give it a private fake mode, as on real tensors, so that the tracker never sees those shadow tensors."""
    from torch.distributed.tensor import _sharding_prop

    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *args: None  # type: ignore[assignment]
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original  # type: ignore[assignment]
