"""From a policy and the blocks found in a model to a per-block plan: which mode each block gets, which modules are
wrapped, which segments are formed, and which fallbacks are taken (and why). Pure: nothing is wrapped here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

from remat.checkpointing.discovery import ATTENTION_NAMES, MLP_NAMES, Block, BlockSearch, find_norms
from remat.checkpointing.plan import CheckpointingWarning, CheckpointPlan, LayerPlan, MoESelectiveWarning
from remat.checkpointing.policy import CheckpointPolicy, Mode, segment_count, split_into_segments
from remat.errors import CheckpointingError

_RECOMPUTES_WHOLE_BLOCK: frozenset[str] = frozenset({"full", "selective"})


@dataclass(frozen=True)
class _Request:
    mode: Mode
    offload: bool
    note: str


def resolve_plan(policy: CheckpointPolicy, search: BlockSearch, model_class: str) -> CheckpointPlan:
    """The plan for ``policy`` over the blocks in ``search``; warns (`CheckpointingWarning`) about fallbacks taken
    and poor choices. Raises `CheckpointingError` when the policy does not fit the model or would wrap nothing."""
    blocks = search.blocks
    _check_fits(policy, len(blocks))
    requests = [_request(policy, i) for i in range(len(blocks))]
    segment_of = _segments(policy, blocks)
    layers = [
        _with_tiling(_layer(block, requests[block.index], segment_of.get(block.index)), block, policy)
        for block in blocks
    ]
    layers = _split_segments_at_fallbacks(layers)
    notes = list(_notes(policy, blocks, layers, search))
    plan = CheckpointPlan(policy, model_class, tuple(layers), search.container, tuple(notes))
    if policy.enabled and not plan.wrapped_modules:
        raise CheckpointingError(
            f"policy {policy.describe()!r} wraps nothing in {model_class}: none of its {len(blocks)} blocks "
            f"({search.container}) gets a checkpointed module. {_why_nothing(layers)}"
        )
    return plan


def _check_fits(policy: CheckpointPolicy, num_blocks: int) -> None:
    if policy.every_n_layers > num_blocks:
        raise CheckpointingError(
            f"policy.every_n_layers: got {policy.every_n_layers}, but the model has only {num_blocks} blocks; "
            f"allowed: 1 to {num_blocks}"
        )
    for override in policy.layers:
        if override.last >= num_blocks:
            raise CheckpointingError(
                f"policy.layers: the key {override.key!r} names a block past the last one; the model has "
                f"{num_blocks} blocks (0-{num_blocks - 1})"
            )
    if policy.segments is not None and segment_count(policy.segments, num_blocks) > num_blocks:
        raise CheckpointingError(
            f"policy.segments: got {policy.segments}, more segments than the model's {num_blocks} blocks; "
            f"allowed: 1 to {num_blocks}, or 'sqrt'"
        )


def _request(policy: CheckpointPolicy, index: int) -> _Request:
    override = policy.override_for(index)
    if override is not None:
        return _Request(override.mode, override.offload or override.mode == "offload", f"layers[{override.key!r}]")
    if index % policy.every_n_layers != 0:
        return _Request("none", False, f"every_n_layers={policy.every_n_layers}: not selected")
    return _Request(policy.mode, policy.offload or policy.mode == "offload", "")


def _segments(policy: CheckpointPolicy, blocks: tuple[Block, ...]) -> dict[int, tuple[int, int]]:
    if policy.segments is None:
        return {}
    ranges = split_into_segments(len(blocks), segment_count(policy.segments, len(blocks)))
    return {i: (r[0], r[-1]) for r in ranges for i in r}


def _layer(block: Block, request: _Request, segment: tuple[int, int] | None) -> LayerPlan:
    mode, note = request.mode, request.note
    if block.kv_sharing == "store" and (mode in ("full", "selective", "attention")):
        mode = "mlp" if block.mlp else "none"
        note = _join(
            note,
            "KV-sharing producer: later layers read the keys/values it computes, so recomputing its attention "
            f"would write them again; {'only its MLP is recomputed' if block.mlp else 'left as is (no MLP found)'}",
        )
        segment = None
    if mode == "attention" and not block.attention:
        raise _missing_submodule(block, "attention", ATTENTION_NAMES)
    if mode == "mlp" and not block.mlp:
        raise _missing_submodule(block, "mlp", MLP_NAMES)
    if block.is_moe and mode == "selective":
        note = _join(note, "MoE block: selective saves expert outputs; full is usually better")
    return LayerPlan(
        index=block.index,
        name=block.name,
        block_type=block.type_name,
        requested=request.mode,
        mode=mode,
        wrapped=_wrapped_names(block, mode),
        offload=request.offload and mode != "none",
        segment=segment if mode == "full" else None,
        note=note,
    )


def _with_tiling(layer: LayerPlan, block: Block, policy: CheckpointPolicy) -> LayerPlan:
    """``layer`` with its MLP and its norms (direct children) tiled when the policy asks for tiling and the block
    is treated at all (``wrapped`` stays in module order; ``tiled`` lists the MLPs, then the norms)."""
    if not policy.tiled or layer.mode == "none":
        return layer
    where = f"block {block.index} ({block.name}, {block.type_name})"
    if block.is_moe:
        raise CheckpointingError(
            f"policy.tiled: {where} is a mixture-of-experts block: its router groups the tokens per expert and its "
            "load-balancing loss is taken over all of them, so running it over chunks of the sequence changes what "
            "it computes; each expert already sees only its share of the tokens. Leave tiled off for this model "
            "(tiling applies to every block that is checkpointed; only a per-layer mode 'none' exempts one)"
        )
    if not block.mlp:
        raise CheckpointingError(
            f"policy.tiled: no MLP sub-module found in {where}; searched children named {', '.join(MLP_NAMES)} and "
            "sub-modules whose class name says mlp / feedforward / ffn. Leave tiled off for this model"
        )
    order = {f"{block.name}.{sub}" if sub else block.name: i for i, (sub, _) in enumerate(block.module.named_modules())}
    norms = find_norms(block.module)
    tiled = tuple(f"{block.name}.{sub}" for sub in (*block.mlp, *norms))
    wrapped = tuple(sorted({*layer.wrapped, *tiled}, key=order.__getitem__))
    return replace(layer, wrapped=wrapped, tiled=tiled, tiled_norms=len(norms), tile_tokens=policy.tile_tokens)


def _wrapped_names(block: Block, mode: Mode) -> tuple[str, ...]:
    if mode == "none":
        return ()
    if mode in ("attention", "mlp"):
        return tuple(f"{block.name}.{sub}" for sub in (block.attention if mode == "attention" else block.mlp))
    return (block.name,)


def _split_segments_at_fallbacks(layers: list[LayerPlan]) -> list[LayerPlan]:
    """A segment with a block that fell back (no longer full) becomes the runs of consecutive full blocks around it."""
    members: dict[tuple[int, int], list[int]] = {}
    for layer in layers:
        if layer.segment is not None:
            members.setdefault(layer.segment, []).append(layer.index)
    out = list(layers)
    for indices in members.values():
        for run in _consecutive_runs(indices):
            for i in run:
                out[i] = replace(out[i], segment=(run[0], run[-1]))
    return out


def _consecutive_runs(indices: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _notes(
    policy: CheckpointPolicy, blocks: tuple[Block, ...], layers: list[LayerPlan], search: BlockSearch
) -> list[str]:
    notes = []
    moe_selective = [layer.index for layer, block in zip(layers, blocks) if block.is_moe and layer.mode == "selective"]
    if moe_selective:
        message = (
            f"selective checkpointing on {len(moe_selective)} mixture-of-experts blocks: the experts dominate these "
            "blocks and their matmul outputs are what selective keeps, so it holds much more memory than full for "
            "little time saved; full is the usual choice for MoE. Routing is identical on recompute (the router's "
            "topk is saved)"
        )
        warnings.warn(message, MoESelectiveWarning, stacklevel=4)
        notes.append(message)
    fallbacks = [layer for layer in layers if layer.mode != layer.requested]
    if fallbacks:
        message = (
            f"{len(fallbacks)} KV-sharing producer blocks ({', '.join(str(f.index) for f in fallbacks)}) keep their "
            "attention activations: recomputing them would write the shared keys/values a second time; their MLP "
            "is recomputed instead"
        )
        warnings.warn(message, CheckpointingWarning, stacklevel=4)
        notes.append(message)
    if search.skipped:
        notes.append(
            "blocks outside the language model were not wrapped: " + ", ".join(search.skipped)
            + "; pass block_pattern to choose the blocks yourself"
        )
    tiled = [layer.index for layer in layers if layer.tiled]
    if tiled:
        chunk = f"{policy.tile_tokens} tokens" if policy.tile_tokens else "as many tokens as the hidden size"
        notes.append(
            f"the MLPs and norms of {len(tiled)} blocks run over chunks of {chunk}, each recomputed on its own in "
            "backward: no [tokens, intermediate] tensor exists whole; costs one more MLP forward per step"
        )
    if policy.offload or any(layer.mode == "offload" for layer in layers):
        notes.append("offload keeps saved activations in host memory; tensors already on the CPU are not copied")
    return notes


def _missing_submodule(block: Block, kind: str, names: tuple[str, ...]) -> CheckpointingError:
    return CheckpointingError(
        f"policy mode {kind!r}: no {kind} sub-module found in block {block.index} ({block.name}, {block.type_name}); "
        f"searched children named {', '.join(names)} and sub-modules whose class name says {kind}. "
        f"Children are: {', '.join(n for n, _ in block.module.named_children()) or 'none'}. Use mode 'full' or "
        "'selective' for this model, or a per-layer exception for such blocks"
    )


def _why_nothing(layers: list[LayerPlan]) -> str:
    reasons = sorted({layer.note for layer in layers if layer.note})
    return ("Reasons: " + "; ".join(reasons)) if reasons else "Check the policy's mode and per-layer exceptions"


def _join(first: str, second: str) -> str:
    return f"{first}; {second}" if first else second
