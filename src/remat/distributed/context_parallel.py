"""Context parallelism: one sequence spread over the ``cp_size`` ranks of a context-parallel group.

Each rank of the group holds a contiguous shard of every row (``tokens / cp_size`` tokens) everywhere but inside
attention, where an all-to-all over the group swaps it for *all* tokens of ``heads / cp_size`` heads; a second
all-to-all after the attention kernel swaps back. `ContextShards.shard` cuts a batch; the attention
implementations registered here (``remat_cp_sdpa``, ``remat_cp_eager``) do the swaps around remat's document-wise
kernels (`remat.models.document_attention`), so causal attention, packed documents and sliding windows are exact on
the whole sequence. `DistributedSetup` builds the group (mesh dimension ``cp``) and switches the model over.

NOTE [ context parallelism by all-to-all over heads ]
Two ways to run attention over a sequence cut into shards exist: pass the key/value shards around a ring (PyTorch's
``context_parallel``, ring attention), or swap the cut from tokens to heads for the attention call (all-to-all
sequence parallelism: DeepSpeed Ulysses, ALST). remat uses the second on every device:

- it runs on gloo, so the CPU tests exercise the very path GPUs run (ring attention is CUDA-only in PyTorch);
- any attention kernel works unchanged inside it: SDPA, eager with softcapping, sliding windows, document-wise
  attention over packed rows (a document crossing a shard boundary is whole again inside attention);
- per layer each rank sends and receives 4 tensors of its shard's size (queries, keys, values in, the output back):
  ``4 x tokens/cp x hidden`` elements, flat in ``cp``, where a ring moves the whole key/value sequence;
- its limit: the heads must divide by ``cp_size`` (key/value heads that do not are replicated, see below).

The all-to-all is ``torch.distributed._functional_collectives.all_to_all_single_autograd`` (the collective torch
points the deprecated ``torch.distributed.nn.functional.all_to_all_single`` to): differentiable, on gloo and NCCL.

NOTE [ grouped key/value heads under context parallelism ]
Rank ``r`` attends with query heads ``[r H/N, (r+1) H/N)``. When the ``Hkv`` key/value heads divide by ``N``, rank
``r`` gets key/value heads ``[r Hkv/N, ...)``, exactly those its query heads read. Otherwise each key/value head is
repeated ``e = N / gcd(Hkv, N)`` times before the swap (``e`` divides the group size ``H / Hkv`` whenever ``N``
divides ``H``), and the kernel sees a module whose ``num_key_value_groups`` is divided by ``e``: the same pairs of
query and key heads, at the cost of ``e`` times the key/value traffic.

NOTE [ the labels of a shard ]
Position ``t`` predicts token ``t + 1``, so the last position of rank ``r``'s shard predicts the first token of rank
``r + 1``'s. `shard` therefore shifts the labels of the whole row first and hands each rank its slice of the
*targets*; the loss is called with ``shift=False`` (`remat.loss.targets.next_token_targets`). Each rank's loss is
the sum over its shard divided by the label tokens of the whole step, so the ranks' losses add up to the step's
loss, and their gradients (summed by DDP / FSDP2 over the ``dp x cp`` ranks) to its gradients.

NOTE [ the length of a row ]
A row whose length does not divide by ``cp_size`` is padded at its end to the next multiple (at most ``cp_size - 1``
tokens): the padding positions continue the last document's positions and carry no label, and a causal model's
real tokens never attend to tokens after them, so the loss and the gradients are those of the unpadded row.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import nn

from remat.data import IGNORE_INDEX
from remat.distributed.layout import check_heads
from remat.errors import ConfigError, RematError

CP_SDPA: Final[str] = "remat_cp_sdpa"
CP_EAGER: Final[str] = "remat_cp_eager"
#: the attention implementation a model runs -> the kernel run inside the context-parallel swap.
_INNER: Final[dict[str, str]] = {"sdpa": "sdpa", "eager": "eager", "remat_document_sdpa": "sdpa",
                                 "remat_document_eager": "eager", CP_SDPA: "sdpa", CP_EAGER: "eager"}
_CACHE_SIZE = 4


@dataclass(eq=False)
class ContextShards:
    """This rank's place in its context-parallel group: ``shard`` cuts a batch for it; the attention swaps run over
    ``group``."""

    group: dist.ProcessGroup
    size: int
    rank: int
    attention_calls: int = 0
    """Context-parallel attention calls so far (the no-op guard compares them with the model's blocks)."""
    _positions: list[tuple[weakref.ref[torch.Tensor], torch.Tensor]] = field(default_factory=list, repr=False)

    # ------------------------------------------------------------------------------------------------ batches

    def shard(self, inputs: dict[str, Any], labels: torch.Tensor, *, ignore_index: int
              ) -> tuple[dict[str, Any], torch.Tensor]:
        """This rank's slice of every row of ``inputs`` (``input_ids``, ``position_ids``: made when absent) and of
        the next-token targets of ``labels`` (see NOTE [ the labels of a shard ]); the row padded first when its
        length does not divide by the group (NOTE [ the length of a row ])."""
        if inputs.get("attention_mask") is not None:
            raise ConfigError(f"distributed.cp_size: {self.size} cannot take an attention_mask with left padding or "
                              "holes (packed rows need none; right padding is fine); pass rows without one")
        input_ids = inputs["input_ids"]
        rows, length = input_ids.shape
        positions = inputs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=input_ids.device)[None].expand(rows, length)
        positions = positions.expand(rows, length)
        targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)
        pad = -length % self.size
        if pad:
            input_ids = torch.nn.functional.pad(input_ids, (0, pad), value=0)
            extra = positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)
            positions = torch.cat([positions, extra], dim=1)
            targets = torch.nn.functional.pad(targets, (0, pad), value=ignore_index)
        width = (length + pad) // self.size
        cut = slice(self.rank * width, (self.rank + 1) * width)
        local_positions = positions[:, cut]
        self._remember(local_positions, positions)
        out = {key: value for key, value in inputs.items() if key != "attention_mask"}
        out.update(input_ids=input_ids[:, cut], position_ids=local_positions)
        return out, targets[:, cut].contiguous()  # contiguous: transformers views its shift_labels flat

    def _remember(self, local: torch.Tensor, full: torch.Tensor) -> None:
        alive = [(ref, whole) for ref, whole in self._positions if ref() is not None]
        self._positions = [*alive[-(_CACHE_SIZE - 1):], (weakref.ref(local), full)]

    def full_positions(self, local: Any) -> torch.Tensor | None:
        """The whole rows' ``position_ids`` of a shard `shard` made (found by identity; gathered over the group
        otherwise: every rank misses alike, the model code being the same), or None without any."""
        if not isinstance(local, torch.Tensor):
            return None
        for ref, full in self._positions:
            if ref() is local:
                return full
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------------------------------------------ swaps

    def heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, heads, tokens/N, dim]`` (this rank's tokens, every head) -> ``[rows, heads/N, tokens, dim]``."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        rows, heads, tokens, dim = x.shape
        send = x.reshape(rows, self.size, heads // self.size, tokens, dim).transpose(0, 1).contiguous()
        got = all_to_all_single_autograd(send, None, None, self.group)  # got[j]: rank j's tokens, my heads
        return got.permute(1, 2, 0, 3, 4).reshape(rows, heads // self.size, self.size * tokens, dim)

    def sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, tokens, heads/N, dim]`` (a kernel's output, all tokens) -> ``[rows, tokens/N, heads, dim]``."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        rows, tokens, heads, dim = x.shape
        send = x.reshape(rows, self.size, tokens // self.size, heads, dim).transpose(0, 1).contiguous()
        got = all_to_all_single_autograd(send, None, None, self.group)  # got[j]: my tokens, rank j's heads
        return got.permute(1, 2, 0, 3, 4).reshape(rows, tokens // self.size, self.size * heads, dim)


# ------------------------------------------------------------------------------------------------ the active group

# NOTE [ one context-parallel group per process ]
# A process belongs to one context-parallel group, and the attention implementations are looked up by name in
# transformers' registry, where nothing but the module and the tensors reach them; checkpointed blocks also run
# attention again during backward, outside any context manager of the forward. The group is therefore this module's
# state, set once by `enable` (`DistributedSetup.parallelize`) and cleared by `disable` (`DistributedSetup.close`).
_ACTIVE: list[ContextShards] = []


def active() -> ContextShards:
    """The process's context-parallel group; `RematError` when none is enabled."""
    if not _ACTIVE:
        raise RematError(f"context-parallel attention ({CP_SDPA} / {CP_EAGER}) runs only in a process whose "
                         "DistributedSetup has cp_size > 1; switch the model back to sdpa or eager")
    return _ACTIVE[0]


class _GroupedView:
    """The attention module as the kernel sees it when key/value heads were repeated: ``num_key_value_groups``
    divided by the repeat (NOTE [ grouped key/value heads under context parallelism ]), the rest read through."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _attention(inner: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    from remat.models.document_attention import attend_per_document

    cp = active()
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % cp.size:
        raise ConfigError(f"distributed.cp_size: {cp.size} must divide the attention heads ({heads} in "
                          f"{type(module).__name__}); allowed: a divisor of {heads}")
    if key.shape[2] != query.shape[2] or attention_mask is not None:
        raise RematError(f"context parallelism: {type(module).__name__} attends with a key/value cache or its own "
                         "mask, which cannot be split over ranks; train without cp_size for this model")
    view: Any = module
    repeat = cp.size // math.gcd(kv_heads, cp.size)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        view = _GroupedView(module, heads // (kv_heads * repeat))
    cp.attention_calls += 1
    kwargs["position_ids"] = cp.full_positions(kwargs.get("position_ids"))
    query, key, value = (cp.heads_to_sequence(t) for t in (query, key, value))
    out, _ = attend_per_document(inner, view, query, key, value, kernel_owner=module, **kwargs)
    return cp.sequence_to_heads(out), None


def cp_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA over the whole sequence for ``heads / cp_size`` heads (see the module docstring)."""
    return _attention("sdpa", module, query, key, value, attention_mask, **kwargs)


def cp_eager(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The model's eager attention over the whole sequence for ``heads / cp_size`` heads."""
    return _attention("eager", module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface

    # Registered with the attention interface only (not its mask interface): transformers then builds no mask,
    # and the kernels run causally (per document) on the whole sequence.
    AttentionInterface.register(CP_SDPA, cp_sdpa)
    AttentionInterface.register(CP_EAGER, cp_eager)


def enable(model: nn.Module, cp: ContextShards, *, tp_size: int = 1) -> str:
    """Make ``cp`` the process's group and switch ``model`` (a transformers model, optionally peft-wrapped) to
    context-parallel attention; returns the implementation's name. `ConfigError` naming ``distributed.cp_size`` for
    a model whose attention cannot be split. With tensor parallelism (``tp_size``) each rank attends with
    ``heads / tp_size`` heads, which the context-parallel ranks split again."""
    from remat.models.document_attention import current_attention

    _register()
    name = current_attention(model)
    inner = _INNER.get(name or "")
    if inner is None:
        raise ConfigError(f"distributed.cp_size: {cp.size} needs the sdpa or eager attention implementation; the "
                          f"model runs {name!r} (set model.attn_implementation: sdpa or eager)")
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    check_heads(heads, cp.size, tp_size)
    target = CP_SDPA if inner == "sdpa" else CP_EAGER
    try:
        model.set_attn_implementation(target)  # type: ignore[operator]
    except (ValueError, AttributeError, TypeError) as err:
        raise ConfigError(f"distributed.cp_size: {type(model).__name__} cannot switch its attention implementation "
                          f"({err}); allowed for this model: cp_size 1") from err
    _ACTIVE[:] = [cp]
    return target


def disable() -> None:
    """Forget the process's context-parallel group."""
    _ACTIVE.clear()


def cut_model_calls(model: nn.Module, cp: ContextShards, sum_over_dp: Callable[[list[float]], list[float]],
                    shard_count: int) -> None:
    """Cut every call of ``model`` (a transformers causal LM called directly, as `remat.AutoModelForCausalLM`'s
    users do) to this rank's shard, with a forward pre-hook.

    ``input_ids`` (and ``position_ids``, ``attention_mask`` with right padding only) are the whole rows, as each rank
    of the group is given them. With ``labels`` the model's own loss gets the shard's next-token targets
    (``shift_labels``) and ``num_items_in_batch``: the label tokens of the whole batch (``sum_over_dp``: a collective,
    every rank calls the model together) divided by ``shard_count``, so that each rank's loss is ``shard_count`` times
    its share and DDP / FSDP2, averaging over the ``dp x cp`` ranks, give the gradients of the batch's mean loss; the
    mean of the ranks' losses is the batch's loss. The outputs (logits, hidden states) are the shard's."""

    def hook(module: nn.Module, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        from remat.models.document_attention import is_right_padding

        if args:
            kwargs = {"input_ids": args[0], **kwargs}
            if len(args) > 1:
                raise ConfigError("context parallelism: call the model with keyword arguments past input_ids "
                                  "(model(input_ids=..., labels=...)); the rows are cut before it runs")
        if not isinstance(kwargs.get("input_ids"), torch.Tensor):
            raise ConfigError("context parallelism: the model must be given input_ids (whole rows, cut here); "
                              "inputs_embeds cannot be cut")
        if kwargs.get("num_items_in_batch") is not None or kwargs.get("shift_labels") is not None:
            raise ConfigError("context parallelism: num_items_in_batch and shift_labels are set here from the whole "
                              "batch; pass labels only")
        mask = kwargs.pop("attention_mask", None)
        inputs = {key: kwargs.pop(key) for key in ("input_ids", "position_ids") if kwargs.get(key) is not None}
        if isinstance(mask, torch.Tensor) and not is_right_padding(mask):
            inputs["attention_mask"] = mask  # refused by `shard` in one line
        labels = kwargs.pop("labels", None)
        cut, targets = cp.shard(inputs, labels if labels is not None else inputs["input_ids"],
                                ignore_index=IGNORE_INDEX)
        kwargs.update(cut)
        if labels is not None:
            count = sum_over_dp([float((labels[..., 1:] != IGNORE_INDEX).sum())])[0]
            kwargs.update(labels=targets, shift_labels=targets,
                          num_items_in_batch=torch.tensor(max(count, 1.0) / shard_count, device=targets.device))
        return (), kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)


def check_every_block_attends(cp: ContextShards, calls_before: int, blocks: int) -> None:
    """After a model's first forward: every transformer block must have run context-parallel attention, or the
    model mixes tokens some other way (a state-space or convolution layer) that sees only this rank's shard."""
    calls = cp.attention_calls - calls_before
    if calls < blocks:
        raise ConfigError(f"distributed.cp_size: {cp.size}: only {calls} of the model's {blocks} blocks ran attention "
                          "that can be split over ranks (the others mix tokens some other way, e.g. a state-space or "
                          "convolution layer); allowed for this model: cp_size 1")
