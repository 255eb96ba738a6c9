"""Causal attention per packed document, without a dense ``[tokens, tokens]`` mask.

A packed row holds several documents; ``position_ids`` restart where a document starts (`remat.data.packing`). Given
such ``position_ids``, transformers' ``sdpa`` and ``eager`` implementations build a block-diagonal causal mask of
``batch x tokens x tokens`` elements (1 GiB of booleans at 32k tokens, 1 TB at a million). The implementations
registered here (``remat_document_sdpa``, ``remat_document_eager``) are registered with transformers'
``AttentionInterface`` only, not with its ``AttentionMaskInterface``, so transformers builds no mask for them
(``masking_utils._preprocess_mask_arguments`` hands ``attention_mask=None`` to an implementation it has no mask
function for). Instead they read the document boundaries from the ``position_ids`` the decoder layers pass down and
run transformers' own ``sdpa_attention_forward`` (or the model's own ``eager_attention_forward``, softcapping
included) causally on each document's slice of the queries, keys and values, then concatenate the outputs. The
boundaries follow transformers' rule (``find_packed_sequence_indices``): a document starts wherever a position is not
the previous one plus one, and at the start of every row.

- **One host sync per forward**: the boundaries are read to the host once per ``position_ids`` tensor and cached on
  that tensor's identity (and version), so the other layers and the recompute of checkpointed blocks reuse them.
  The read happens in a forward pre-hook of each decoder layer, outside any checkpointed region (see the NOTE at
  :func:`read_documents_before_the_layer`).
- **No or fake ``position_ids``** (the estimate's fake tensors, the meta device): each row is one document, an upper
  bound of the memory and FLOPs of a packed row.
- **Sliding windows** (``sliding_window`` passed by the layer): a document longer than the window runs in query
  chunks of ``window`` tokens against keys ``[chunk start - window + 1, chunk end)`` with a banded mask of at most
  ``window x (2 window - 1)`` elements; nothing of a document's square size.
- **Cost**: the queries, keys and values are cut with ``split`` (whose backward writes each token's gradient once,
  where slicing would make a full-length gradient per document), and the outputs are joined by one ``cat``: one
  more ``[rows, tokens, heads, dim]`` tensor than the dense path while the cat runs. Each document is one kernel
  call, so rows of many short documents pay the calls' overhead (a small model on the CPU: measured in
  ``benchmarks/results/document_attention.md``), and long rows skip the dense path's masked-out blocks.
- **eager**: each slice gets an additive causal mask of its own size (the eager kernel holds the slice's scores
  anyway); its attention weights are not returned (``output_attentions`` yields None).
- **Grouped KV heads, dropout, softcap, KV-shared layers**: passed through to the wrapped kernel per slice (dropout
  draws per slice, so its masks differ from the dense path's draws; checkpoint recompute replays them exactly).
- **Padding masks**: transformers drops a 2-D ``attention_mask`` for these implementations, which is exact only for
  masks of ones or right padding (a real token attends only to the tokens before it). `guard_padding_mask` refuses
  any other mask (left padding, holes) with a `ConfigError` before the model runs. With right padding the documents
  stay apart; transformers' own path, given any 2-D mask, stops looking for packed documents and lets them attend to
  each other (the recipe drops right-padding masks before the model runs, so its packed rows never reach that).
- **No cuDNN attention** for the per-document calls on CUDA: it builds a plan per new length (NOTE [ No cuDNN
  attention per document ]).
- CUDA's ``torch.nn.attention.varlen.varlen_attn`` (one kernel call for all documents) is not used: its signature
  differs between torch versions and it cannot be tested without a GPU; the per-document loop runs everywhere.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from remat.errors import ConfigError, RematError
from remat.models.config import DocumentAttention, check_document_attention

logger = logging.getLogger(__name__)


SDPA_NAME: Final[str] = "remat_document_sdpa"
EAGER_NAME: Final[str] = "remat_document_eager"
#: transformers' implementation -> its document-wise variant.
DOCUMENT_IMPLEMENTATIONS: Final[dict[str, str]] = {"sdpa": SDPA_NAME, "eager": EAGER_NAME}
_CACHE_SIZE = 4


# ------------------------------------------------------------------------------------------------------- boundaries

@dataclass(frozen=True)
class Documents:
    """Document boundaries: per row, the start offsets of its documents followed by the row length."""

    rows: tuple[tuple[int, ...], ...]

    @property
    def uniform(self) -> bool:
        """Every row is cut at the same offsets (or there is one row of boundaries for the whole batch)."""
        return all(row == self.rows[0] for row in self.rows[1:])


def _compute_documents(position_ids: torch.Tensor) -> Documents | None:
    """The boundaries of ``position_ids`` ([rows, tokens]): one device-to-host copy of a boolean per token (None
    when the comparison comes out fake, as it may under a fake-tensor mode)."""
    rows, length = position_ids.shape
    restarts = position_ids[:, 1:] != position_ids[:, :-1] + 1  # no factory call: stays real under the estimate
    if is_fake(restarts):
        return None
    found = restarts.cpu().nonzero().tolist()  # the one host sync (the rest runs on the host copy)
    offsets: list[list[int]] = [[0] for _ in range(rows)]
    for row, offset in found:
        offsets[row].append(offset + 1)
    return Documents(tuple((*row_offsets, length) for row_offsets in offsets))


class _DocumentCache:
    """The last few ``position_ids`` tensors' boundaries, keyed on the tensor's identity and version."""

    def __init__(self) -> None:
        self._entries: list[tuple[weakref.ref[torch.Tensor], int, Documents | None]] = []
        self.one_per_row = False
        """The last ``position_ids`` read hold one document per row (NOTE [ Document attention under
        torch.compile ])."""

    def documents(self, position_ids: torch.Tensor) -> Documents | None:
        documents = self._documents(position_ids)
        self.one_per_row = documents is None or all(len(row) == 2 for row in documents.rows)
        return documents

    def _documents(self, position_ids: torch.Tensor) -> Documents | None:
        version = position_ids._version
        for ref, cached_version, documents in self._entries:
            if ref() is position_ids and cached_version == version:
                return documents
        documents = _compute_documents(position_ids)
        self._entries = [entry for entry in self._entries if entry[0]() is not None][-(_CACHE_SIZE - 1):]
        self._entries.append((weakref.ref(position_ids), version, documents))
        return documents


_CACHE = _DocumentCache()


def documents_of(position_ids: Any, batch: int, length: int) -> Documents | None:
    """The documents of a ``[batch, length]`` attention call, or None when each row is one document (no or fake
    ``position_ids``, or no restart in them)."""
    if torch.compiler.is_compiling() and _CACHE.one_per_row:  # NOTE [ Document attention under torch.compile ]
        return None
    if not isinstance(position_ids, torch.Tensor) or is_fake(position_ids) or position_ids.device.type == "meta":
        return None
    if position_ids.ndim != 2 or position_ids.shape[1] != length or position_ids.shape[0] not in (1, batch):
        raise RematError(f"document attention: position_ids of shape {tuple(position_ids.shape)} do not match the "
                         f"attention's {batch} rows of {length} tokens; use model.document_attention: false for "
                         "this model")
    documents = _CACHE.documents(position_ids)
    return None if documents is None or all(len(row) == 2 for row in documents.rows) else documents


# NOTE [ Boundaries are read outside checkpointed regions ]
# Selective checkpointing replays the forward's per-op decisions by call index in the recompute (torch 2.11 asks the
# policy again and remat replays; torch 2.13+ replays its own cache by index), and on an accelerator it saves the
# device-to-host copy of the boundary read. Read inside layer 0's checkpointed forward and then found in the cache by
# its recompute, that copy made the recompute's ``_to_copy`` calls one fewer than the forward's: the next cast (the
# RMSNorm's ``.to(float32)``) was handed the saved boolean host copy ("Autograd not support dtype: Bool", seen on an
# H200 with torch 2.11). Module hooks run in ``__call__``, outside the region a wrapped layer checkpoints, and the
# recompute does not run them again: a pre-hook on each decoder layer fills the cache before any region starts, so the
# forward and the recompute of every layer make the same ops (none) for the boundaries.


# NOTE [ Document attention under torch.compile ]
# The boundaries are host data read from the values of ``position_ids``, which dynamo cannot trace: an attention call
# that looks them up breaks the graph, and inside a checkpointed region, where dynamo cannot resume after a break, the
# whole block then runs eagerly (found by the estimate's simulated compile: `full` and `selective` with compiled
# blocks ran eager blocks on the H200). Rows of one document each (what a batch without packing, or the benchmarks'
# synthetic rows, holds) need no boundaries: the layer's pre-hook, which reads them before the layer runs, records
# that (``_CACHE.one_per_row``), and a traced attention call takes the dense causal path without looking. Dynamo
# guards the compiled graph on that flag, so a later batch of packed rows recompiles and breaks the graph as before.


@torch.compiler.disable  # host data: dynamo would break its graph at every line (NOTE above)
def read_documents_before_the_layer(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a decoder layer: read the boundaries of its ``position_ids`` into the cache (see the NOTE
    above); the attention inside the layer then finds them there, in the forward and in the recompute alike."""
    position_ids = kwargs.get("position_ids")
    if (isinstance(position_ids, torch.Tensor) and position_ids.ndim == 2 and not is_fake(position_ids)
            and position_ids.device.type != "meta"):
        _CACHE.documents(position_ids)


def _decoder_layers(decoder: nn.Module) -> list[nn.Module]:
    """The modules of the decoder's own layer lists (``decoder.layers`` and the like)."""
    return [layer for child in decoder.children() if isinstance(child, nn.ModuleList) for layer in child]


# ------------------------------------------------------------------------------------------------ per-slice kernels

Kernel = Callable[..., tuple[torch.Tensor, Any]]


def _allowed(q_length: int, k_length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[q, k] booleans for queries that are the last ``q_length`` of ``k_length`` consecutive tokens: key j is
    visible to query i when j <= i and (with a window) j > i - window."""
    q = torch.arange(k_length - q_length, k_length, device=device)[:, None]
    k = torch.arange(k_length, device=device)[None, :]
    allowed = k <= q
    return allowed & (k > q - window) if window is not None else allowed


class _Masks:
    """The masks of one attention call, made once per shape: booleans for SDPA, additive for eager."""

    def __init__(self, eager: bool, window: int | None, dtype: torch.dtype, device: torch.device) -> None:
        self.eager, self.window, self.dtype, self.device = eager, window, dtype, device
        self._made: dict[tuple[int, int], torch.Tensor] = {}

    def get(self, q_length: int, k_length: int) -> torch.Tensor:
        made = self._made.get((q_length, k_length))
        if made is None:
            allowed = _allowed(q_length, k_length, self.window, self.device)
            if self.eager:
                zeros = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
                allowed = zeros.masked_fill(~allowed, torch.finfo(self.dtype).min)
            made = self._made[(q_length, k_length)] = allowed[None, None]
        return made


def _document(kernel: Kernel, masks: _Masks, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The outputs ([rows, tokens, heads, dim]) of causal attention within one document's queries, keys and values.

    With a window shorter than the document, queries go in chunks of ``window`` tokens against the keys from
    ``window - 1`` tokens before the chunk (``split`` and a two-piece ``cat``, so backward copies each token once)."""
    length, window = query.shape[2], masks.window
    if window is None or length <= window:  # every key of the document is within the window
        mask = masks.get(length, length) if masks.eager or window is not None else None
        return [kernel(module, query, key, value, mask, **kwargs)[0]]
    out = []
    chunks = list(zip(query.split(window, 2), key.split(window, 2), value.split(window, 2), strict=True))
    for i, (q, k, v) in enumerate(chunks):
        if i:
            k = torch.cat([chunks[i - 1][1][:, :, 1:], k], dim=2)
            v = torch.cat([chunks[i - 1][2][:, :, 1:], v], dim=2)
        out.append(kernel(module, q, k, v, masks.get(q.shape[2], k.shape[2]), **kwargs)[0])
    return out


def _row_pieces(kernel: Kernel, masks: _Masks, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, bounds: tuple[int, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """Every document's outputs, in order, for rows cut at ``bounds``."""
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    split = zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    return [piece for q, k, v in split for piece in _document(kernel, masks, module, q, k, v, kwargs)]


def _document_attention(kernel: Kernel, eager: bool, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any
                        ) -> tuple[torch.Tensor, None]:
    batch, _, length, _ = query.shape
    if attention_mask is not None or key.shape[2] != length:  # a caller's own 4-D mask, or a KV cache: as given
        return kernel(module, query, key, value, attention_mask, **kwargs)
    if not getattr(module, "is_causal", True):
        raise RematError(f"document attention: {type(module).__name__} is not causal; use "
                         "model.document_attention: false for this model")
    with _without_cudnn_attention(query.device, eager):
        return _documents_attended(kernel, eager, module, query, key, value, **kwargs)


# NOTE [ No cuDNN attention per document ]
# Each packed document is its own SDPA call, of its own length, and packed rows bring new lengths every step. On CUDA,
# torch picks cuDNN's attention first where it can (torch 2.11, H100, bf16), and cuDNN builds and caches an
# execution plan per new shape: measured on an H100 with the seed recipe (Llama-3.2-1B, 8 packed rows of 2048
# tokens, full checkpointing), steps took 2.6 s instead of 0.45 s for as long as new lengths kept coming, which in
# real data is the whole run (benchmarks/results/gpu_acceptance_nvidia_h100_80gb_hbm3.md). Flash and memory-efficient
# attention take any length with no per-shape plan, so the per-document calls run with cuDNN's attention left out
# (the other backends as the user has them enabled; nothing changes when cuDNN is the only one enabled).
@contextlib.contextmanager
def _without_cudnn_attention(device: torch.device, eager: bool) -> Iterator[None]:
    if eager or device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enabled = [backend for backend, on in ((SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
                                           (SDPBackend.EFFICIENT_ATTENTION,
                                            torch.backends.cuda.mem_efficient_sdp_enabled()),
                                           (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled())) if on]
    if not enabled:
        yield
        return
    with sdpa_kernel(enabled):
        yield


def _documents_attended(kernel: Kernel, eager: bool, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
    batch, _, length, _ = query.shape
    masks = _Masks(eager, kwargs.pop("sliding_window", None), query.dtype, query.device)
    kwargs.pop("is_causal", None)
    documents = documents_of(kwargs.get("position_ids"), batch, length)
    if documents is None or documents.uniform:
        bounds = (0, length) if documents is None else documents.rows[0]
        pieces = _row_pieces(kernel, masks, module, query, key, value, bounds, kwargs)
        return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)), None
    rows = zip(query.split(1), key.split(1), value.split(1), documents.rows, strict=True)
    pieces = [piece for q, k, v, bounds in rows for piece in _row_pieces(kernel, masks, module, q, k, v, bounds,
                                                                         kwargs)]
    flat = torch.cat(pieces, dim=1)  # [1, rows x tokens, heads, dim]: one copy, then a view per row
    return flat.view(batch, length, *flat.shape[2:]), None


def _model_eager(module: nn.Module) -> Kernel:
    """The eager kernel of the module's own modelling file (where softcapping and other variants live)."""
    kernel = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if kernel is None:
        raise RematError(f"document attention: {type(module).__module__} has no eager_attention_forward; use "
                         "model.document_attention: false for this model")
    return kernel  # type: ignore[no-any-return]


def remat_document_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, run causally per packed document (see the module docstring)."""
    return _document_attention(sdpa_attention_forward, False, module, query, key, value, attention_mask, **kwargs)


def remat_document_eager(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The model's own eager attention, run causally per packed document (see the module docstring)."""
    return _document_attention(_model_eager(module), True, module, query, key, value, attention_mask, **kwargs)


def attend_per_document(implementation: str, module: Any, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, *, kernel_owner: nn.Module | None = None, **kwargs: Any
                        ) -> tuple[torch.Tensor, None]:
    """Causal attention per document of ``implementation`` (``"sdpa"`` or ``"eager"``) with no mask, for a caller
    that hands ``module`` in a form of its own (context parallelism's view with fewer key/value groups):
    ``kernel_owner`` is the attention module whose modelling file gives the eager kernel (``module`` by default)."""
    eager = implementation == "eager"
    kernel = _model_eager(kernel_owner if kernel_owner is not None else module) if eager else sdpa_attention_forward
    return _document_attention(kernel, eager, module, query, key, value, None, **kwargs)


AttentionInterface.register(SDPA_NAME, remat_document_sdpa)
AttentionInterface.register(EAGER_NAME, remat_document_eager)


# ------------------------------------------------------------------------------------------------------- switching

def is_right_padding(mask: torch.Tensor) -> bool:
    """True when every row of ``mask`` (``[..., tokens]``, 0/1) is ones followed by zeros (or ones only)."""
    if mask.dtype == torch.bool:
        mask = mask.to(torch.int8)
    if mask.numel() == 0 or bool(((mask != 0) & (mask != 1)).any()):
        return False
    return bool((mask[..., 1:] <= mask[..., :-1]).all())


def guard_padding_mask(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: refuse a 2-D ``attention_mask`` that transformers would drop inexactly (see the docstring)."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if isinstance(mask, torch.Tensor) and mask.ndim == 2 and not is_fake(mask) and not is_right_padding(mask):
        raise ConfigError(
            "model.document_attention: an attention_mask with left padding or holes cannot be combined with "
            "document-wise attention (packed rows need none; right padding is fine); pass no attention_mask, or set "
            "model.document_attention: false (document_attention=False in Python) for transformers' dense mask")


def current_attention(model: nn.Module) -> str | None:
    """The model's attention implementation name (``config._attn_implementation``)."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def use_document_attention(model: nn.Module, setting: DocumentAttention, *, packed: bool | None) -> str:
    """Switch ``model`` (a transformers model) to document-wise attention when ``setting`` asks for it, and return one
    line saying which attention runs and why (also logged).

    ``"auto"``: on when rows may hold several documents (``packed`` True, or None: unknown, as for a model built in
    Python) and the model runs ``sdpa`` or ``eager`` (a row of one document runs the same kernel call either way).
    True: on, or a `ConfigError` when the model runs another implementation. False: transformers' own path.
    """
    setting = check_document_attention(setting)
    name = current_attention(model)
    if name in DOCUMENT_IMPLEMENTATIONS.values():
        return f"attention: {name} (already document-wise)"
    variant = DOCUMENT_IMPLEMENTATIONS.get(name or "")
    if setting is False or (setting == "auto" and (packed is False or variant is None)):
        why = ("model.document_attention is false" if setting is False else
               "rows are not packed" if packed is False else "document-wise attention wraps only sdpa and eager")
        line = f"attention: {name} ({why}; transformers builds its own mask for packed rows)"
    elif variant is None:
        raise ConfigError(f"model.document_attention: true needs the sdpa or eager attention implementation; the "
                          f"model runs {name!r} (set model.attn_implementation: sdpa or eager, or "
                          "model.document_attention: auto)")
    else:
        model.set_attn_implementation(variant)  # type: ignore[operator]
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        decoder.register_forward_pre_hook(guard_padding_mask, with_kwargs=True)  # type: ignore[union-attr]
        for layer in _decoder_layers(decoder):  # type: ignore[arg-type]
            layer.register_forward_pre_hook(read_documents_before_the_layer, with_kwargs=True)
        reason = ("model.document_attention is true" if setting is True else
                  "packed rows" if packed else "rows may be packed")
        line = (f"attention: {variant} ({name} per document, {reason}: no [tokens, tokens] mask is built; "
                "model.document_attention: false turns it off)")
    logger.info(line)
    return line
