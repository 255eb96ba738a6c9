"""What each checkpointing mode costs one block: bytes it keeps for backward and FLOPs it recomputes, measured once
on fake tensors.

The recipe's model is built under ``FakeTensorMode`` (nothing allocated), its forward is run up to the first block
of each distinct kind to capture that block's real call arguments (hidden states, position embeddings, mask), and
then that block alone runs forward and backward once per mode, wrapped by `apply_activation_checkpointing` exactly
as in training, inside a `LiveTensorTracker` (bytes) and torch's ``FlopCounterMode`` (FLOPs). Blocks of one kind
(same class, parameter shapes, attention type and KV-sharing role) cost the same, so a 16-layer Llama measures one
block. The bytes are those of the step the estimate simulates (same dtype, autocast and attention kernel: the CUDA
kernel for ``target="cuda"``). A recipe that compiles its blocks has each mode's block compiled as the simulated step
compiles it (`remat.estimate.compiled`): its bytes are what the backend's partition keeps, its FLOPs those of the
partitioned graphs, counted as they run.

NOTE [ block costs under context and tensor parallelism ]
With ``cp_size`` N a rank runs each block on its ``1/N`` shard of the tokens, and inside attention on all tokens of
``1/N`` of the heads: every term of a block's kept bytes and FLOPs (the projections and MLP per token, attention per
head over the whole row) is ``1/N`` of the whole row's. The block is measured on the whole row in one process (no
process group is needed) and its costs divided by N: the planner's per-rank share. What a candidate policy's step
peaks at is priced by the estimate, which simulates the real rank (`remat.estimate.simulate`), so the budget check
does not rest on this division.

With ``tp_size`` T the block's linear layers and attention heads are split over T ranks, its norms and residual
stream are not: a rank computes about ``1/T`` of the block's FLOPs (the matmuls) but keeps between ``1/T`` and all of
its bytes (a checkpointed block's input is the whole hidden state on every rank). The FLOPs are divided by T, the
bytes are not (an upper bound); again the estimate, which runs the tensor-parallel rank, prices each candidate.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
import warnings
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from remat._logs import quiet_log
from remat.checkpointing import CheckpointPolicy, apply_activation_checkpointing
from remat.checkpointing.discovery import Block, find_blocks
from remat.checkpointing.policy import LayerOverride
from remat.checkpointing.apply import remove_activation_checkpointing
from remat.checkpointing.policy import Mode
from remat.errors import ConfigError
from remat.estimate.attention import CudaAttention
from remat.estimate.compiled import (CompiledRegionTracker, SimulatedCompile, simulated_compile,
                                     simulated_recompile_limit)
from remat.estimate.fake_model import build_fake_model
from remat.estimate.run import SimulatedRun
from remat.estimate.choices import Target
from remat.estimate.simulate import DATA_DEPENDENT_ERRORS, make_batch, simulation_mode, with_routing_fallback
from remat.memory import LiveTensorTracker
from remat.recipes.config import CompileConfig, RecipeConfig

#: The per-block modes the planner chooses among, from keeping everything to recomputing the whole block.
CANDIDATE_MODES: tuple[Mode, ...] = ("none", "attention", "mlp", "selective", "full")

_aten = torch.ops.aten


@dataclass(frozen=True)
class ModeCost:
    """One mode on one block: ``kept_bytes`` held from the block's forward until its backward (its output, the next
    block's input, not included), ``recompute_flops`` that backward recomputes, ``backward_peak_bytes`` the most
    the block's backward holds above what it kept (recomputed activations, gradients of its inputs). What the
    recompute costs by op class (`OpCounts`, NOTE [ What recompute costs by op class ]): ``recompute_flops`` includes
    ``recompute_attention_flops``; ``recompute_memory_bytes`` are the bytes the recomputed memory-bound ops write."""

    mode: Mode
    kept_bytes: int
    recompute_flops: int
    backward_peak_bytes: int
    recompute_attention_flops: int = 0
    recompute_memory_bytes: int = 0


@dataclass(frozen=True)
class BlockKind:
    """Blocks that cost the same: their indices and the cost of each candidate mode (modes the block cannot take,
    e.g. ``attention`` without an attention sub-module, or that fall back to another, are left out)."""

    name: str
    indices: tuple[int, ...]
    costs: tuple[ModeCost, ...]
    flops: int
    """Forward plus backward FLOPs of one block without checkpointing."""
    is_moe: bool = False
    """Mixture-of-experts blocks (`remat.checkpointing.discovery.is_moe_block`)."""

    def cost(self, mode: Mode) -> ModeCost:
        """The cost of ``mode`` (KeyError when this kind cannot take it)."""
        for cost in self.costs:
            if cost.mode == mode:
                return cost
        raise KeyError(mode)


@dataclass(frozen=True)
class BlockMeasurements:
    """Every block's kind, and what the step computes outside the blocks."""

    block_names: tuple[str, ...]
    kinds: tuple[BlockKind, ...]
    head_flops: int
    """FLOPs of the output projection, forward and backward (6 x tokens x hidden x vocabulary)."""
    seconds: float

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    def kind_of(self, index: int) -> BlockKind:
        """The kind of block ``index``."""
        return next(kind for kind in self.kinds if index in kind.indices)

    @property
    def step_flops(self) -> int:
        """Forward plus backward FLOPs of one micro-batch without checkpointing (blocks and output projection)."""
        return sum(kind.flops * len(kind.indices) for kind in self.kinds) + self.head_flops


def measure_blocks(recipe: RecipeConfig, run: SimulatedRun) -> BlockMeasurements:
    """Measure every candidate mode on one block of each kind of ``recipe``'s model (see the module docstring)."""
    with quiet_checkpointing_log():
        measured, _ = with_routing_fallback(
            recipe, lambda balanced_routing: _measure_blocks(recipe, run, balanced_routing))
    return measured


@contextlib.contextmanager
def quiet_checkpointing_log() -> Iterator[None]:
    """`apply_activation_checkpointing` logs each plan it applies at INFO; the planner applies many while it
    measures and prices, and says itself what it chose."""
    with quiet_log("remat.checkpointing.apply"):
        yield


def _measure_blocks(recipe: RecipeConfig, run: SimulatedRun, balanced_routing: bool) -> BlockMeasurements:
    start = time.perf_counter()
    block_run = _BlockRun(run.target, _compute_dtype(recipe), balanced_routing, recipe.compile)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    net = build_fake_model(recipe, fake, vocab_size=run.vocab_size)
    if recipe.distributed.policy.block_pattern is not None:
        search = find_blocks(net, recipe.distributed.policy.block_pattern)
    else:
        search = find_blocks(net)
    groups = _group_blocks(search.blocks)
    vocab = int(net.config.get_text_config().vocab_size)
    batch = make_batch(recipe, run, vocab)
    calls = _capture_calls(net, [group[0] for group in groups], batch, fake, block_run)
    share = recipe.distributed.cp_size  # NOTE [ block costs under context and tensor parallelism ]
    flops_share = share * recipe.distributed.tp_size
    kinds = []
    for group in groups:
        first = group[0]
        raw = {mode: (kept // share, counts.divided(share, flops_share), peak // share)
               for mode, (kept, counts, peak) in _measure_kind(net, first, calls[first.index], fake, block_run).items()}
        base = raw["none"][1]
        kinds.append(BlockKind(
            name=_kind_name(first, len(groups)),
            indices=tuple(block.index for block in group),
            costs=tuple(ModeCost(mode, kept, *counts.beyond(base).flops_and_peak(backward_peak))
                        for mode, (kept, counts, backward_peak) in raw.items()),
            flops=base.flops, is_moe=first.is_moe,
        ))
    hidden = int(net.config.get_text_config().hidden_size)
    tokens = recipe.step_scheduler.local_batch_size * recipe.dataset.seq_length // share
    return BlockMeasurements(
        block_names=tuple(block.name for block in search.blocks), kinds=tuple(kinds),
        head_flops=6 * tokens * hidden * vocab, seconds=time.perf_counter() - start,
    )


# --- one block, one mode -----------------------------------------------------------------------------------------


def _measure_kind(net: nn.Module, block: Block, call: tuple[tuple[Any, ...], dict[str, Any]],
                  fake: FakeTensorMode, block_run: _BlockRun) -> dict[Mode, tuple[int, OpCounts, int]]:
    """(kept bytes, forward + backward op counts, backward peak) per mode the block gets, ``none`` first; a mode
    that falls back to one already measured (a KV-sharing producer's attention) is left out."""
    out: dict[Mode, tuple[int, OpCounts, int]] = {}
    for mode in CANDIDATE_MODES:
        if (mode == "attention" and not block.attention) or (mode == "mlp" and not block.mlp):
            continue
        applied: Mode = mode
        if mode != "none":
            policy = CheckpointPolicy(mode="none", layers=(LayerOverride(block.index, block.index, mode),))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                applied = apply_activation_checkpointing(net, policy).layers[block.index].mode
        try:
            if applied not in out:
                out[applied] = _run_block(block.module, call, fake, block_run)
        finally:
            remove_activation_checkpointing(net)
            for param in block.module.parameters():
                param.grad = None
    return out


@dataclass(frozen=True)
class _BlockRun:
    """How a block runs while it is measured: as in the simulated step (`remat.estimate.simulate.simulation_mode`,
    with the same expert-routing fallback), with the step's attention kernel and compute dtype, and compiled as the
    recipe's ``compile`` section compiles it (`remat.estimate.compiled`)."""

    target: Target
    compute_dtype: torch.dtype | None
    balanced_routing: bool
    compile: CompileConfig = field(default_factory=CompileConfig)

    def compiled(self) -> SimulatedCompile | None:
        """A fresh simulated compile backend for one measurement, or None for eager blocks."""
        return simulated_compile(self.compile)

    def __call__(self, fake: FakeTensorMode) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(fake)
        if self.target == "cuda":
            stack.enter_context(CudaAttention())
        stack.enter_context(simulation_mode(self.target, balanced_routing=self.balanced_routing))
        if self.compute_dtype is not None:
            stack.enter_context(torch.autocast("cpu", dtype=self.compute_dtype))
        return stack


def _run_block(module: nn.Module, call: tuple[tuple[Any, ...], dict[str, Any]], fake: FakeTensorMode,
               block_run: _BlockRun) -> tuple[int, OpCounts, int]:
    args, kwargs = call
    compiled = block_run.compiled()
    with block_run(fake):
        hidden, args, kwargs = _fresh_hidden(args, kwargs)
        if compiled is None:
            with LiveTensorTracker() as tracker, count_ops() as counter:
                kept, backward_peak = _forward_backward(module, args, kwargs, tracker)
                del hidden
            return kept, counter.counts(), backward_peak
        # counted inside each graph run: a counting mode around the call would make dynamo run the block eagerly
        graph_counts = _GraphCounts()
        compiled.around_graph = graph_counts.count
        forward = torch.compile(module.forward, backend=compiled, fullgraph=block_run.compile.fullgraph,
                                dynamic=block_run.compile.dynamic)
        try:
            with simulated_recompile_limit(), CompiledRegionTracker() as tracker:
                kept, backward_peak = _forward_backward(forward, args, kwargs, tracker)
                del hidden
        except (*DATA_DEPENDENT_ERRORS, ConfigError):
            raise
        except Exception:
            if compiled.graphs == 0:
                raise
            compiled.runs = 0  # it cannot run compiled on fake tensors: the step's simulation falls back too
    if compiled.runs == 0:  # dynamo ran the block eagerly (as the run will): count it as such
        return _run_block(module, call, fake, dataclasses.replace(block_run, compile=CompileConfig()))
    return kept, graph_counts.total, backward_peak


def _forward_backward(forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                      tracker: LiveTensorTracker) -> tuple[int, int]:
    """(bytes kept from the forward for backward, the most the backward holds above them) of one block call."""
    result = forward(*args, **kwargs)
    output = result if isinstance(result, torch.Tensor) else next(t for t in result if isinstance(t, torch.Tensor))
    kept = tracker.current_bytes - output.untyped_storage().nbytes()
    tracker.reset_peak()
    if output.requires_grad:  # NOTE [ Blocks that compute without autograd ]
        output.backward(torch.ones_like(output))
    return kept, tracker.peak_bytes - kept


class _GraphCounts:
    """The op counts of every graph a simulated compiled block runs (forward, backward), summed."""

    def __init__(self) -> None:
        self.total = OpCounts(0)

    @contextlib.contextmanager
    def count(self) -> Iterator[None]:
        with count_ops() as counter:
            yield
        self.total = self.total + counter.counts()


# NOTE [ Blocks that compute without autograd ]
# Reversible layers (transformers' Reformer) run their forward under ``torch.no_grad()`` and are recomputed by the
# model's own autograd function in backward: measured alone, the block keeps nothing and its output has no gradient
# to follow. Every mode then costs what ``none`` costs, so the planner keeps such blocks as they are; the step the
# estimate simulates for each candidate, with the model's own backward, prices it.


def _fresh_hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, tuple[Any, ...],
                                                                           dict[str, Any]]:
    """The call with its hidden states replaced by a leaf that requires grad (so backward reaches the block), and
    mappings among the arguments copied: blocks may write into them (KV-sharing layers store keys and values in a
    dict that later layers read), and each measurement must start from what the forward passed."""
    args = tuple(_copied(arg) for arg in args)
    kwargs = {name: _copied(value) for name, value in kwargs.items()}
    if args and isinstance(args[0], torch.Tensor):
        hidden = args[0].detach().requires_grad_()
        return hidden, (hidden, *args[1:]), kwargs
    hidden = kwargs["hidden_states"].detach().requires_grad_()
    return hidden, args, {**kwargs, "hidden_states": hidden}


def _copied(value: Any) -> Any:
    """``value`` with mappings (dicts, transformers' ``KVSharingDict``) copied, recursively; tensors shared."""
    if isinstance(value, MutableMapping):
        out = copy.copy(value)
        for key in list(value.keys()):
            out[key] = _copied(value[key])
        return out
    return value


class _Captured(Exception):
    """Raised by the capture hook once every wanted block has been called: the rest of the forward is not run."""


def _capture_calls(net: nn.Module, blocks: list[Block], batch: dict[str, torch.Tensor], fake: FakeTensorMode,
                   block_run: _BlockRun) -> dict[int, tuple[tuple[Any, ...], dict[str, Any]]]:
    """The arguments each of ``blocks`` is called with in the model's forward on ``batch``."""
    calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    wanted = {block.index for block in blocks}

    def hook(index: int) -> Any:
        def capture(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls[index] = (tuple(_copied(arg) for arg in args), {k: _copied(v) for k, v in kwargs.items()})
            if set(calls) >= wanted:
                raise _Captured
        return capture

    handles = [block.module.register_forward_pre_hook(hook(block.index), with_kwargs=True) for block in blocks]
    try:
        with block_run(fake), torch.no_grad():
            net(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    except _Captured:
        pass
    finally:
        for handle in handles:
            handle.remove()
    missing = wanted - set(calls)
    if missing:
        raise ConfigError(f"distributed.activation_checkpointing: the planner could not observe blocks "
                          f"{sorted(missing)} in the model's forward; give a concrete policy instead of 'auto'")
    return calls


# --- what recompute costs by op class ----------------------------------------------------------------------------

# NOTE [ What recompute costs by op class ]
# A FLOP of a matmul, a FLOP of attention and an element-wise op (which torch's FLOP counter counts as zero) do not
# take the same time: matmuls run near the device's peak, attention kernels below it, and norms, activations,
# dropout and casts are bound by memory bandwidth. Selective checkpointing recomputes mostly the last kind, full
# checkpointing mostly the first, so pricing both by FLOPs alone can rank them wrongly. Each block's forward and
# backward is therefore counted by class: FLOPs (torch's counter with `FLOP_FORMULAS`), of which attention's, and the
# bytes written by every other op that makes a new tensor (not views): the memory-bound work. The planner prices
# each class at its own rate (`remat.planner.timing.RecomputeRates`), calibrated by `remat profile`; without
# calibrated rates only the FLOPs count, as before.


@dataclass(frozen=True)
class OpCounts:
    """Forward plus backward work of one block under one mode: ``flops`` (attention's included),
    ``attention_flops``, and ``memory_bytes`` written by memory-bound ops."""

    flops: int
    attention_flops: int = 0
    memory_bytes: int = 0

    def divided(self, share: int, flops_share: int) -> OpCounts:
        """A rank's part under context (``share``) and tensor parallelism (``flops_share``): see the module NOTE."""
        return OpCounts(self.flops // flops_share, self.attention_flops // flops_share, self.memory_bytes // share)

    def __add__(self, other: OpCounts) -> OpCounts:
        return OpCounts(self.flops + other.flops, self.attention_flops + other.attention_flops,
                        self.memory_bytes + other.memory_bytes)

    def beyond(self, base: OpCounts) -> OpCounts:
        """What this counts beyond ``base`` (never negative): a mode's recompute against ``none``."""
        return OpCounts(max(0, self.flops - base.flops), max(0, self.attention_flops - base.attention_flops),
                        max(0, self.memory_bytes - base.memory_bytes))

    def flops_and_peak(self, backward_peak: int) -> tuple[int, int, int, int]:
        """The `ModeCost` fields after ``kept_bytes``, in order."""
        return self.flops, backward_peak, self.attention_flops, self.memory_bytes


class _OpClassCounter(TorchDispatchMode):
    """Bytes written by ops outside torch's FLOP formulas (memory-bound ops), views and compute ops left out."""

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.memory_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if isinstance(func, HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func in FLOP_FORMULAS or func._overloadpacket in flop_registry):
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.memory_bytes += tensor.numel() * tensor.element_size()
        return out


class _Counter:
    def __init__(self, flops: FlopCounterMode, classes: _OpClassCounter) -> None:
        self._flops, self._classes = flops, classes

    def counts(self) -> OpCounts:
        attention = sum(count for op, count in self._flops.get_flop_counts().get("Global", {}).items()
                        if "attention" in str(op))
        return OpCounts(int(self._flops.get_total_flops()), int(attention), self._classes.memory_bytes)


@contextlib.contextmanager
def count_ops() -> Iterator[_Counter]:
    """Count the work of what runs inside, by op class (NOTE [ What recompute costs by op class ]); ``.counts()``
    after the block."""
    flops = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
    classes = _OpClassCounter()
    with flops, classes:
        yield _Counter(flops, classes)


# --- grouping, dtypes, FLOP formulas -------------------------------------------------------------------------------


def _group_blocks(blocks: tuple[Block, ...]) -> list[list[Block]]:
    groups: dict[tuple[Any, ...], list[Block]] = {}
    for block in blocks:
        groups.setdefault(_kind_key(block), []).append(block)
    return list(groups.values())


def _kind_key(block: Block) -> tuple[Any, ...]:
    shapes = tuple((name, tuple(p.shape), p.dtype) for name, p in block.module.named_parameters())
    attention_type = getattr(block.module, "attention_type", None)
    return block.type_name, block.kv_sharing, block.is_moe, attention_type, shapes


def _kind_name(block: Block, kinds: int) -> str:
    if kinds == 1:
        return block.type_name
    extras = [str(x) for x in (getattr(block.module, "attention_type", None), block.kv_sharing) if x]
    return f"{block.type_name} (block {block.index}{', ' + ', '.join(extras) if extras else ''})"


def _compute_dtype(recipe: RecipeConfig) -> torch.dtype | None:
    """The dtype blocks compute in: the autocast dtype, or FSDP2's mixed-precision parameter dtype."""
    name = recipe.model.autocast or recipe.distributed.mixed_precision
    return getattr(torch, name) if name else None


def _query_heads(query: Any, *shapes: Any) -> list[tuple[int, ...]]:
    """Key/value shapes ``[batch, heads, seq, dim]`` with the query's head count: grouped-query attention does the
    work of every query head (torch's counters before 2.13 refuse fewer key/value heads)."""
    return [(shape[0], query[1], *shape[2:]) for shape in shapes]


def _attention_flops(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query, *_query_heads(query, key, value)))


def _attention_backward_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any,
                                  out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out, query, *_query_heads(query, key, value)))


def _grouped_mm_flops(mat_a: Any, mat_b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """``torch._grouped_mm`` (MoE experts): every row of ``mat_a`` meets one group of ``mat_b``."""
    if len(mat_a) == 2 and len(mat_b) == 3:  # (tokens, k) x (groups, k, n)
        return 2 * mat_a[0] * mat_a[1] * mat_b[2]
    if len(mat_a) == 3 and len(mat_b) == 3:  # batched
        return 2 * mat_a[0] * mat_a[1] * mat_a[2] * mat_b[2]
    if len(mat_a) == 2 and len(mat_b) == 2:  # (m, tokens) x (tokens, n): weight gradients
        return 2 * mat_a[0] * mat_a[1] * mat_b[1]
    if len(mat_a) == 3 and len(mat_b) == 2:
        return 2 * mat_a[0] * mat_a[1] * mat_a[2] * mat_b[1]
    return 0


def _flop_mapping() -> dict[Any, Any]:
    """Formulas torch's FLOP counter lacks: the CPU attention kernel and its backward, the CUDA kernels with
    grouped-query heads (torch before 2.13 refuses them), and grouped matmuls."""
    mapping: dict[Any, Any] = {}
    for kernel in ("flash_attention_for_cpu", "flash_attention", "efficient_attention", "cudnn_attention"):
        forward = getattr(_aten, f"_scaled_dot_product_{kernel}", None)
        backward = getattr(_aten, f"_scaled_dot_product_{kernel}_backward", None)
        if forward is not None:
            mapping[forward] = _attention_flops
        if backward is not None:
            mapping[backward] = _attention_backward_flops
    grouped = getattr(_aten, "_grouped_mm", None)
    if grouped is not None:
        mapping[grouped] = _grouped_mm_flops
    return mapping


FLOP_FORMULAS: dict[Any, Any] = _flop_mapping()
"""``FlopCounterMode(custom_mapping=FLOP_FORMULAS)`` also counts CPU attention, grouped-query attention on every
supported torch, and MoE grouped matmuls."""

