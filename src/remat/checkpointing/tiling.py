"""Sequence tiling: a block's MLP and norms run over chunks of the tokens, each chunk under its own non-reentrant
checkpoint.

An MLP is position-wise: token t's output depends on token t's input only (so are LayerNorm and RMSNorm, which are
tiled the same way: their fp32 internals are then never kept for all tokens). So its input ``[..., hidden]`` is
flattened to ``[tokens, hidden]``, split into chunks of ``tile_tokens`` rows, and each chunk runs through the MLP
under ``torch.utils.checkpoint`` (non-reentrant); the chunk outputs are concatenated. Forward keeps no chunk's
intermediates (checkpoint saves only the chunk's input, a view of the MLP input), and backward recomputes and
differentiates one chunk at a time, so only one ``[tile_tokens, intermediate]`` tensor (and the few like it inside
the MLP) is alive at any moment instead of ``[tokens, intermediate]``.

Composition: under full or selective checkpointing of the block, the block's recompute runs the tiled modules
again, which again keep nothing but chunk inputs; each chunk is recomputed a second time when backward reaches it.
The price is one more MLP (and norm) forward per step than without tiling. Dropout inside the MLP draws its mask
per chunk, and checkpoint restores the RNG state of each chunk on recompute, so forward and recompute agree (the
masks may differ from an untiled run's, as re-chunking random draws can). Attention is not tiled: it mixes tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.checkpointing.wrappers import Runner, WrapKind, input_as_positional
from remat.errors import CheckpointingError


def default_tile_tokens(hidden_size: int) -> int:
    """The chunk length when ``tile_tokens`` is not given: as many tokens as the hidden size, so one chunk's
    ``[tile, intermediate]`` tensor holds as many elements as one MLP projection weight ``[hidden, intermediate]``
    (which is resident anyway). For Llama-3.2-1B: 2,048 tokens, 32 MiB in bf16 instead of 16 GiB at 1M tokens."""
    return max(1, hidden_size)


class TiledRunner(Runner):
    """Run a position-wise module (an MLP, a norm) over chunks of its tokens, each chunk checkpointed (see the
    module docstring).

    ``tile_tokens`` is the chunk length (None: `default_tile_tokens` of the input's last dimension); ``where``
    names the module in error messages (e.g. ``"model.layers.3.mlp in block 3"``).
    """

    kind: WrapKind = "tiled"
    recomputes = True

    def __init__(self, tile_tokens: int | None, where: str) -> None:
        self.tile_tokens = tile_tokens
        self.where = where

    def __call__(
        self, module: nn.Module, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        fn, args, kwargs = input_as_positional(inner, args, kwargs)
        if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            raise CheckpointingError(
                f"tiled: {self.where} ({type(module).__name__}) was called without a [..., tokens, hidden] "
                "tensor as its input, so its tokens cannot be split into chunks; remove tiled for this model"
            )
        hidden, rest = args[0], args[1:]
        tile = self.tile_tokens or default_tile_tokens(hidden.shape[-1])
        flat = hidden.reshape(-1, hidden.shape[-1])
        outputs = [checkpoint(fn, chunk, *rest, use_reentrant=False, **kwargs) for chunk in flat.split(tile)]
        for out, chunk in zip(outputs, flat.split(tile)):
            if not isinstance(out, torch.Tensor) or out.shape[:-1] != chunk.shape[:-1]:
                got = type(out).__name__ if not isinstance(out, torch.Tensor) else f"shape {tuple(out.shape)}"
                raise CheckpointingError(
                    f"tiled: {self.where} ({type(module).__name__}) is not position-wise: for a chunk of "
                    f"shape {tuple(chunk.shape)} it returned {got}, not one tensor with a row per token; remove "
                    "tiled for this model"
                )
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return out.reshape(*hidden.shape[:-1], out.shape[-1])
