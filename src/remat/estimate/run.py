"""`SimulatedRun`: what the estimate must be told beyond a recipe (the device it models, the processes, the data)."""

from __future__ import annotations

from dataclasses import dataclass

from remat.estimate.choices import Target


@dataclass(frozen=True)
class SimulatedRun:
    """What a recipe leaves to the launch and the data, which the simulation must be told: the device it models
    (``target``), the number of processes (``world_size``; torchrun decides it for a recipe without
    ``distributed.dp_size``), the documents packed per row of the synthetic batch and the vocabulary (the
    tokenizer's; None keeps the model config's)."""

    target: Target = "cuda"
    world_size: int = 1
    documents_per_row: int = 1
    vocab_size: int | None = None
    copy_cpu_tensors: bool | None = None
    """Whether an offloading policy's context copies tensors that are already on the CPU to its host buffers: None
    decides by ``target`` (see `remat.estimate.offload.offload_copies_cpu_tensors`)."""
