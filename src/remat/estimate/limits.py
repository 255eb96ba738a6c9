"""The sizes the estimate simulates, and the ones it refuses up front.

The simulated step runs on fake tensors, so the model's parameters, activations and optimizer state cost no host
memory whatever their size (a 1M-wide model answers in seconds with its terabytes). A few things are real or grow
with a setting, and set these limits:

- the micro-batch's integer tensors (``input_ids``, ``labels``, ``position_ids``) are real, so that the code that
  reads their values (label counts, row selection, transformers' mask decision) runs as in training: about 100 bytes
  of host memory per token with what is computed from them. ``MAX_MICRO_BATCH_TOKENS`` (2^24 tokens, ~1.6 GB of host
  memory) bounds ``batch_size x seq_length``; no single device holds the activations of a micro-batch that large.
- every layer is a Python module that the simulation builds and runs (about 0.2 s a layer on a 2-core CPU):
  ``MAX_LAYERS`` bounds ``num_hidden_layers`` (the deepest published decoders have ~130 layers).
- the micro-batches a GPU step holds are counted one by one, and FSDP2 over a fake process group loops over the
  ranks: ``MAX_GRAD_ACCUMULATION`` and ``MAX_WORLD_SIZE`` bound those.
"""

from __future__ import annotations

from typing import Any, Final

from remat.errors import ConfigError

MAX_MICRO_BATCH_TOKENS: Final[int] = 2**24
MAX_LAYERS: Final[int] = 512
MAX_GRAD_ACCUMULATION: Final[int] = 4096
MAX_WORLD_SIZE: Final[int] = 2**16


def check_simulated_sizes(*, batch_size: int, seq_length: int, grad_accumulation: int, world_size: int,
                          num_layers: Any = None) -> None:
    """Raise `ConfigError` naming the key and the limit when a size is beyond what the estimate simulates."""
    tokens = batch_size * seq_length
    if tokens > MAX_MICRO_BATCH_TOKENS:
        raise ConfigError(
            f"batch_size x seq_length: {batch_size} x {seq_length} = {tokens:,} tokens per micro-batch is above the "
            f"estimate's limit of {MAX_MICRO_BATCH_TOKENS:,} (2^24; the simulation holds the micro-batch's token ids "
            "for real, ~100 bytes of host memory per token); no single device holds the activations of such a "
            "micro-batch: lower batch_size or seq_length")
    checks = (("grad_accumulation", grad_accumulation, MAX_GRAD_ACCUMULATION),
              ("world_size", world_size, MAX_WORLD_SIZE),
              ("model.config.num_hidden_layers", num_layers, MAX_LAYERS))
    for key, value, limit in checks:
        if isinstance(value, int) and value > limit:
            raise ConfigError(f"{key}: {value:,} is above the estimate's limit of {limit:,} (the simulation's time "
                              "grows with it; see remat.estimate.limits)")
