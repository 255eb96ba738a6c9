"""Activation offload in the simulated step: the recipe's own offload hooks, with their host copies counted apart.

An offloading policy (``offload: true``, mode ``offload``) runs its blocks under the
`remat.checkpointing.offload.OffloadActivations` that the recipe's build made (`CheckpointPlan.offload_context`). The
simulation keeps that context and its settings (``min_bytes``, ``prefetch``, which tensors it skips) and changes two
things only:

- its host buffers are allocated inside the tracker's `LiveTensorTracker.host_allocations`, so they count as host
  memory (``StepTrace.host_peak``) and never in the device peak; pinned ones (on ``target="cuda"`` with the
  context's ``pin_memory``) at the power-of-two size PyTorch's caching host allocator gives them
  (`remat.memory.tracker.pinned_block_bytes`);
- on ``target="cuda"`` it copies tensors that are on the CPU (``copy_cpu_tensors``): the simulation's fake tensors
  live on the CPU but stand for device tensors. On ``target="cpu"`` it does what the recipe's CPU run does, which is
  to leave tensors already in host memory alone, so the offload changes nothing there and uses no host bytes
  (``SimulatedRun.copy_cpu_tensors=True`` models a CPU run whose context copies them, as the tests' does).

What a fake step cannot see, and is assumed: a device tensor is freed as soon as the step drops it once its host copy
is issued (on a GPU the side-stream copy holds its memory until the copy ends: ``record_stream``), and a restored or
prefetched tensor takes its device memory when the copy is issued. Prefetching follows the context's ``prefetch``
(2 by default: while backward uses one restored block input, the next two are on their way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from remat.checkpointing.offload import OffloadActivations
from remat.memory.tracker import LiveTensorTracker, pinned_block_bytes

if TYPE_CHECKING:
    from remat.estimate.run import SimulatedRun


def offload_copies_cpu_tensors(run: SimulatedRun) -> bool:
    """Whether the simulated offload copies tensors on the CPU: ``run.copy_cpu_tensors`` when given, else whether the
    target is a GPU (whose device tensors the simulation's CPU fake tensors stand for)."""
    return run.target == "cuda" if run.copy_cpu_tensors is None else run.copy_cpu_tensors


def count_offload_on_host(plan: Any, tracker: LiveTensorTracker, run: SimulatedRun) -> OffloadActivations | None:
    """Point the offload context of ``plan`` (a `CheckpointPlan` or None) at ``tracker``'s host allocations, with
    pinned sizes on a GPU, and set whether it copies CPU tensors; return the context (None when nothing is
    offloaded)."""
    context = getattr(plan, "offload_context", None)
    if context is None:
        return None
    if not isinstance(context, OffloadActivations):
        raise TypeError(f"the estimate models OffloadActivations only, not {type(context).__name__}")
    context.copy_cpu_tensors = offload_copies_cpu_tensors(run)
    context.host_scope = tracker.host_allocations
    tracker.host_rounding = pinned_block_bytes if run.target == "cuda" and context.pin_memory else None
    context.reset_stats()
    return context


def describe_offload(context: OffloadActivations, host_peak: int) -> str:
    """One note for the estimate: what the offload moved and the host memory it held at most."""
    stats = context.stats
    if not stats.offloaded_tensors:
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(stats.skipped.items())) or "none saved"
        return f"activation offload: nothing copied to host memory (left in place: {reasons})"
    return (f"activation offload: {stats.offloaded_tensors} tensors ({stats.offloaded_bytes / 2**30:.3f} GiB) copied "
            f"to host memory, at most {host_peak / 2**30:.3f} GiB held at once; prefetch {context.prefetch}")
