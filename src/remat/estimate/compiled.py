"""Compiled blocks on fake tensors: what ``torch.compile`` keeps for backward, without generating a kernel.

A recipe's ``compile`` section compiles each decoder block after checkpointing wraps it
(`remat.recipes.build.compile_blocks`). The estimate and the planner simulate such blocks with
`SimulatedCompile`, a ``torch.compile`` backend that does everything the recipe's backend does up to code generation
and then runs the graphs op by op on the simulation's fake tensors.

NOTE [ Compiled blocks on fake tensors ]
What a compiled block holds from its forward to its backward is decided before any kernel exists: dynamo captures
the block (its checkpoint included, as a higher-order op whose regions carry recompute tags), AOTAutograd traces the
joint forward and backward graph with the backend's decompositions, and the backend's partitioner splits it, choosing
which tensors the forward saves and which the backward recomputes (inductor's: its joint-graph passes and the min-cut
partitioner, which recomputes cheap element-wise ops to save fewer, often smaller, tensors; ``aot_eager``'s: the
min-cut partitioner alone; ``cudagraphs``': AOTAutograd's default partition). `SimulatedCompile` runs exactly those
steps, with the same functions, on fake tensors, and hands AOTAutograd, instead of generated code, graphs that
``torch.fx.Interpreter`` runs op by op with the boxed calling convention: each value is freed after its last use and
the backward's saved tensors as it consumes them. The saved tensors are therefore the compiled step's own, shape for
shape (tests/estimate/test_compiled_blocks.py compares them with inductor's real compiled block on the CPU, mode by
mode). What is not modelled: the transient memory inside a fused kernel, which inductor does not materialise and the
interpreter does (so a block's transient peak is an upper bound), and a ``reduce-overhead`` CUDA-graph pool.

Dynamo does not compile a frame while a dispatch mode that watches ops is active (it runs the frame eagerly, as
eager semantics require), so the simulation's modes that must see a compiled block's ops (`CompiledRegionTracker`
and the simulation's own mode) declare ``ignore_compile_internals``: torch then switches them off while it compiles
and on again while the compiled graphs run, where the interpreter dispatches every op through them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Final

import torch
from torch import nn

from remat.checkpointing import CheckpointPolicy
from remat.checkpointing.discovery import find_blocks
from remat.memory import LiveTensorTracker
from remat.recipes.config import CompileConfig

SIMULATED_BACKENDS: Final[tuple[str, ...]] = ("inductor", "aot_eager", "cudagraphs")
"""``compile.backend`` values whose partition the simulation reproduces; ``eager`` compiles nothing that changes
memory (dynamo's graph runs as written), so its blocks are simulated eager."""


class SimulatedCompile:
    """A ``torch.compile`` backend that partitions each graph as ``backend`` does and runs the two halves op by op
    (NOTE [ Compiled blocks on fake tensors ]). ``around_graph``, when set, is a context-manager factory entered
    around every graph run (the planner counts a compiled block's FLOPs there: counting modes outside would make
    dynamo run the block eagerly). ``graphs`` counts the graphs compiled and ``runs`` the graph runs: a caller can
    tell a block that ran compiled from one dynamo fell back to running eagerly."""

    def __init__(self, backend: str = "inductor") -> None:
        if backend not in SIMULATED_BACKENDS:
            raise ValueError(f"SimulatedCompile: backend {backend!r}; allowed: {', '.join(SIMULATED_BACKENDS)}")
        self.backend = backend
        self.around_graph: Callable[[], AbstractContextManager[Any]] | None = None
        self.graphs = 0
        self.runs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd

        self.graphs += 1
        options: dict[str, Any] = {"fw_compiler": self._interpreted, "bw_compiler": self._interpreted,
                                   "keep_inference_input_mutations": True}
        if self.backend == "aot_eager":
            from torch._functorch.partitioners import min_cut_rematerialization_partition

            options["partition_fn"] = min_cut_rematerialization_partition
        if self.backend != "inductor":
            return aot_autograd(**options)(graph, example_inputs)
        from torch._guards import detect_fake_mode
        from torch._inductor.virtualized import V

        options.update(decompositions=_inductor_decompositions(), partition_fn=_inductor_partition())
        # inductor's joint-graph passes make tensors in the fake mode inductor sets around them (random ops' seeds)
        with V.set_fake_mode(detect_fake_mode(example_inputs)):
            return aot_autograd(**options)(graph, example_inputs)

    def _interpreted(self, graph: torch.fx.GraphModule, _example_inputs: Any) -> Callable[[list[Any]], Any]:
        def run(args: list[Any]) -> Any:
            self.runs += 1
            with self.around_graph() if self.around_graph is not None else contextlib.nullcontext():
                return _GraphRun(graph).boxed_run(args)

        run._boxed_call = True  # type: ignore[attr-defined]  # AOTAutograd's convention: args is ours to clear
        return run


class _GraphRun(torch.fx.Interpreter):
    """Runs a partitioned graph op by op, freeing each value after its last use. The RNG higher-order ops that keep
    a recomputed random op's draws equal (``run_and_save_rng_state`` in the forward, ``run_with_rng_state`` in the
    backward) run their op directly: on fake tensors no value is drawn, the generator state the forward saves is
    allocated at its size (the CPU generator's, a few kilobytes), and the op's own outputs are what a counting mode
    must see (torch's FLOP counter does not look inside them)."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is _SAVE_RNG:
            op, *rest = args
            return torch.empty(_RNG_STATE_BYTES, dtype=torch.uint8), op(*rest, **kwargs)
        if target is _WITH_RNG:
            _state, op, *rest = args
            return op(*rest, **kwargs)
        return super().call_function(target, args, kwargs)


_RNG_STATE_BYTES: Final[int] = torch.get_rng_state().numel()
_SAVE_RNG: Final[Any] = getattr(torch.ops.higher_order, "run_and_save_rng_state", None)
_WITH_RNG: Final[Any] = getattr(torch.ops.higher_order, "run_with_rng_state", None)


def _inductor_decompositions() -> Any:
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def _inductor_partition() -> Callable[..., Any]:
    """Inductor's own partition function: its joint-graph passes, then the min-cut partitioner as inductor calls it
    (`torch._inductor.compile_fx.partition_fn`, present from torch 2.4 through 2.15)."""
    from torch._inductor import compile_fx

    return compile_fx.partition_fn  # type: ignore[no-any-return]


def simulated_compile(settings: CompileConfig) -> SimulatedCompile | None:
    """The backend a simulation compiles blocks with under a recipe's ``compile`` ``settings``, or None when they
    run eager (``compile`` off, or dynamo's ``eager`` backend, which changes no memory)."""
    if not settings.enabled or settings.backend not in SIMULATED_BACKENDS:
        return None
    return SimulatedCompile(settings.backend)


def compiled_blocks_notes(settings: CompileConfig, compiled: SimulatedCompile | None) -> list[str]:
    """What a simulated step under ``settings`` says of its compiled blocks (NOTE [ Compiled blocks on fake
    tensors ])."""
    if compiled is None:
        return []
    notes = [f"compile: the blocks are simulated compiled ({compiled.backend}'s partition of each block's forward and "
             "backward: what they save is the compiled step's; the transient memory inside a fused kernel is counted "
             "unfused, an upper bound)"]
    if settings.mode == "reduce-overhead":
        notes.append("compile: mode reduce-overhead records CUDA graphs, whose memory pool is not modelled")
    return notes


EAGER_FALLBACK_NOTE: Final[str] = (
    "compile: dynamo ran the blocks eagerly (a graph break it cannot compile around, e.g. inside a checkpointed "
    "region), as it will in the run: the figure is the eager blocks'")
"""The note of a simulated step whose compiled blocks never ran compiled: simulated again as eager blocks."""


def compile_failure_note(err: BaseException) -> str:
    """The note of a simulated step whose compiled blocks failed on fake tensors (simulated again as eager blocks,
    which hold at least what compiled ones do)."""
    first = (str(err).splitlines() or [""])[0][:160]
    return (f"compile: the compiled blocks could not run on the simulation's fake tensors ({type(err).__name__}: "
            f"{first}): the figure is the eager blocks', an upper bound")


class CompiledRegionTracker(LiveTensorTracker):
    """A `LiveTensorTracker` that lets ``torch.compile`` compile while it is active and sees the compiled graphs'
    ops as they run (NOTE [ Compiled blocks on fake tensors ]): only for graphs `SimulatedCompile` runs, whose ops
    all go through the dispatcher (generated code allocates outside it)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def compile_simulated_blocks(model: nn.Module, policy: CheckpointPolicy, settings: CompileConfig,
                             backend: SimulatedCompile) -> int:
    """The simulation's `remat.recipes.build.compile_blocks`: each block's forward (its checkpoint wrapper
    included) compiled with ``backend`` and the recipe's ``fullgraph`` and ``dynamic``; the module's hooks stay
    outside the compiled region, so the estimate's block boundaries are recorded as in eager blocks. Returns the
    number of blocks compiled."""
    blocks = find_blocks(model, policy.block_pattern).blocks
    for block in blocks:
        module = block.module
        module.forward = torch.compile(  # type: ignore[method-assign]
            module.forward, backend=backend, fullgraph=settings.fullgraph, dynamic=settings.dynamic)
    return len(blocks)


def simulated_recompile_limit() -> AbstractContextManager[Any]:
    """Dynamo's limits raised while a simulation compiles: every simulated step and every measured mode compiles
    the same block code again (another model, another wrapper), and past the default limit dynamo would run the
    block eagerly, silently simulating the wrong step."""
    import torch._dynamo

    return torch._dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 16)
