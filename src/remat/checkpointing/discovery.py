"""Where the blocks are: the transformer blocks of a model, and the attention / MLP sub-modules inside each block.

Blocks are found without a per-architecture table:

1. ``block_pattern`` from the policy, when given: a module path (its children are the blocks) or a regular expression
   matched against full module names (outermost matches win);
2. otherwise inside the language model (``get_decoder()`` of a ``transformers`` model, which is the text tower of a
   multimodal model; peft wrappers are looked through): the outermost ``transformers`` ``GradientCheckpointingLayer``
   instances;
3. otherwise the ``nn.ModuleList`` / ``nn.Sequential`` of same-class modules holding the most parameters.

Blocks of the same kind outside the language model (a vision tower's layers) are reported, not wrapped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final, Literal

from torch import nn

from remat.errors import CheckpointingError

KVSharingRole = Literal["store", "reuse"]
SearchMethod = Literal["block_pattern", "GradientCheckpointingLayer", "ModuleList"]

#: Attribute names of attention sub-modules across architectures (llama ``self_attn``, gpt2 ``attn``, neox
#: ``attention``).
ATTENTION_NAMES: Final[tuple[str, ...]] = ("self_attn", "attn", "attention", "self_attention")
#: Attribute names of MLP / MoE sub-modules across architectures.
MLP_NAMES: Final[tuple[str, ...]] = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "ff")
_ATTENTION_CLASS: Final = re.compile(r"attention", re.IGNORECASE)
_MLP_CLASS: Final = re.compile(r"mlp|feedforward|ffn|moe", re.IGNORECASE)
_MOE_CLASS: Final = re.compile(r"moe|expert|router", re.IGNORECASE)
_NORM_CLASS: Final = re.compile(r"rmsnorm|layernorm|layer_norm", re.IGNORECASE)
_NOT_SUBMODULE_CLASS: Final = re.compile(r"dropout|norm|rotary|embedding", re.IGNORECASE)


@dataclass(frozen=True)
class Block:
    """One transformer block: its index among the blocks, full module name, the module, and what is inside it.

    ``attention`` and ``mlp`` are sub-module names relative to the block (empty when none was recognised);
    ``kv_sharing`` is ``"store"`` for a layer whose keys/values later layers read, ``"reuse"`` for a layer that reads
    another layer's keys/values, else None; ``is_moe`` marks mixture-of-experts blocks.
    """

    index: int
    name: str
    module: nn.Module
    attention: tuple[str, ...]
    mlp: tuple[str, ...]
    kv_sharing: KVSharingRole | None
    is_moe: bool

    @property
    def type_name(self) -> str:
        """The block's class name, e.g. ``LlamaDecoderLayer``."""
        return type(self.module).__name__


@dataclass(frozen=True)
class BlockSearch:
    """The result of `find_blocks`: the blocks in forward order, where they were found, and what was left out."""

    blocks: tuple[Block, ...]
    container: str
    method: SearchMethod
    skipped: tuple[str, ...] = ()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model under peft wrappers (``PeftModel`` -> base model), or ``model`` itself."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        get_base = getattr(type(model), "get_base_model", None)
        if callable(get_base):
            inner = get_base(model)
            if isinstance(inner, nn.Module) and inner is not model:
                model = inner
                continue
        inner = getattr(model, "model", None)
        if type(model).__name__ in ("LoraModel", "PeftMixedModel") and isinstance(inner, nn.Module):
            model = inner
            continue
        break
    return model


def find_decoder(model: nn.Module) -> nn.Module:
    """The language model inside ``model``: ``get_decoder()`` of a transformers model (the text tower of a
    multimodal one), looking through peft wrappers; ``model`` itself when there is no such method."""
    root = unwrap_model(model)
    get_decoder = getattr(root, "get_decoder", None)
    if callable(get_decoder):
        try:
            decoder = get_decoder()
        except (AttributeError, NotImplementedError, ValueError):
            decoder = None
        if isinstance(decoder, nn.Module) and _contains(root, decoder):
            return decoder
    return root


def find_blocks(model: nn.Module, block_pattern: str | None = None) -> BlockSearch:
    """The transformer blocks of ``model`` (see the module docstring for the search order).

    Raises `CheckpointingError` naming the model class and what was searched when nothing is found.
    """
    names = {id(module): name for name, module in model.named_modules()}
    if block_pattern is not None:
        modules = _match_pattern(model, block_pattern)
        return BlockSearch(_describe(modules, names), block_pattern, "block_pattern")

    decoder = find_decoder(model)
    for root in (decoder, model) if decoder is not model else (model,):
        hf_layers = _outermost(root, _is_hf_checkpointing_layer)
        if hf_layers:
            elsewhere = [m for m in _outermost(model, _is_hf_checkpointing_layer) if not _contains(root, m)]
            return BlockSearch(
                _describe(hf_layers, names), _common_parent(hf_layers, names), "GradientCheckpointingLayer",
                _summarise_skipped(elsewhere, names),
            )
        stack = _largest_stack(root)
        if stack is not None:
            return BlockSearch(_describe(list(stack), names), names[id(stack)], "ModuleList")
    where = type(model).__name__
    if decoder is not model:
        where += f" (language model: {names[id(decoder)] or '<root>'})"
    raise CheckpointingError(
        f"no transformer blocks found in {where}: searched for transformers GradientCheckpointingLayer modules and "
        "for an nn.ModuleList / nn.Sequential of same-class modules with parameters. Pass block_pattern: a module "
        "path whose children are the blocks (e.g. 'model.layers') or a regular expression over module names "
        "(e.g. r'encoder\\.blocks\\.\\d+')"
    )


def find_attention(block: nn.Module) -> tuple[str, ...]:
    """Names (relative to ``block``) of its attention sub-modules, by attribute name, else by class name."""
    return _find_submodules(block, ATTENTION_NAMES, _ATTENTION_CLASS)


def find_mlp(block: nn.Module) -> tuple[str, ...]:
    """Names (relative to ``block``) of its MLP or mixture-of-experts sub-modules, by attribute name, else class."""
    return _find_submodules(block, MLP_NAMES, _MLP_CLASS)


def find_norms(block: nn.Module) -> tuple[str, ...]:
    """Names of ``block``'s direct children that normalise each position over its last dimension only (class name
    says RMSNorm or LayerNorm, and a ``normalized_shape``, when there is one, has one dimension), in order.
    Batch/group/instance norms, which mix positions, and norms nested in attention or MLP sub-modules are not
    listed."""
    return tuple(
        name for name, child in block.named_children()
        if _NORM_CLASS.search(type(child).__name__) and len(getattr(child, "normalized_shape", (0,))) == 1
    )


def is_moe_block(block: nn.Module) -> bool:
    """True when ``block`` contains a mixture-of-experts layer (an ``experts`` child, or a MoE/router class)."""
    for name, module in block.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "experts" or _MOE_CLASS.search(type(module).__name__):
            return True
    return False


def kv_sharing_role(block: nn.Module) -> KVSharingRole | None:
    """``"store"`` when later layers read this block's keys/values, ``"reuse"`` when it reads another layer's,
    else None. Read from the attention modules' flags (Gemma 3n / Gemma 4 style ``num_kv_shared_layers``)."""
    for module in block.modules():
        if getattr(module, "store_full_length_kv", False) is True:
            return "store"
        if getattr(module, "is_kv_shared_layer", False) is True:
            return "reuse"
        if getattr(module, "kv_shared_layer_index", None) is not None:
            return "reuse"
    return None


# --- helpers -----------------------------------------------------------------------------------------------------


def _is_hf_checkpointing_layer(module: nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers is a dependency, but keep discovery usable without it
        return False
    return isinstance(module, GradientCheckpointingLayer)


def _outermost(root: nn.Module, predicate: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """Modules under ``root`` (``root`` included) satisfying ``predicate``, skipping those nested in a match."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if predicate(module):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(root)
    return found


def _contains(root: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in root.modules())


def _largest_stack(root: nn.Module) -> nn.ModuleList | nn.Sequential | None:
    best, best_params = None, 0
    for module in root.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
            continue
        children = list(module)
        if len({type(c) for c in children}) != 1:
            continue
        params = sum(p.numel() for c in children for p in c.parameters())
        if params > best_params:
            best, best_params = module, params
    return best


def _match_pattern(model: nn.Module, pattern: str) -> list[nn.Module]:
    by_name = dict(model.named_modules())
    target = by_name.get(pattern)
    if target is not None:
        if isinstance(target, (nn.ModuleList, nn.Sequential)):
            if len(target) == 0:
                raise CheckpointingError(f"block_pattern: {pattern!r} names an empty {type(target).__name__}")
            return list(target)
        return [target]
    regex = re.compile(pattern)
    matched = [m for name, m in by_name.items() if name and regex.fullmatch(name)]
    outer = [m for m in matched if not any(o is not m and _contains(o, m) for o in matched)]
    if not outer:
        examples = ", ".join(repr(n) for n in list(by_name)[1:8])
        raise CheckpointingError(
            f"block_pattern: {pattern!r} matches no module of {type(model).__name__} (neither a module path nor a "
            f"regular expression matching a full module name); module names look like: {examples}, ..."
        )
    return outer


def _describe(modules: list[nn.Module], names: dict[int, str]) -> tuple[Block, ...]:
    return tuple(
        Block(
            index=i,
            name=names.get(id(m), f"<block {i}>"),
            module=m,
            attention=find_attention(m),
            mlp=find_mlp(m),
            kv_sharing=kv_sharing_role(m),
            is_moe=is_moe_block(m),
        )
        for i, m in enumerate(modules)
    )


def _common_parent(modules: list[nn.Module], names: dict[int, str]) -> str:
    parents = {names.get(id(m), "").rpartition(".")[0] for m in modules}
    return parents.pop() if len(parents) == 1 else ", ".join(sorted(parents))


def _summarise_skipped(modules: list[nn.Module], names: dict[int, str]) -> tuple[str, ...]:
    groups: dict[str, int] = {}
    for m in modules:
        parent = names.get(id(m), "").rpartition(".")[0]
        groups[parent] = groups.get(parent, 0) + 1
    return tuple(f"{parent} ({count} blocks)" for parent, count in groups.items())


def _find_submodules(block: nn.Module, attr_names: tuple[str, ...], class_pattern: re.Pattern[str]) -> tuple[str, ...]:
    by_name = [name for name, _ in block.named_children() if name in attr_names]
    if by_name:
        return tuple(by_name)
    return tuple(
        name for name, _ in _outermost_named(block, lambda m: _looks_like(m, class_pattern)) if name
    )


def _looks_like(module: nn.Module, class_pattern: re.Pattern[str]) -> bool:
    cls = type(module).__name__
    return bool(class_pattern.search(cls)) and not _NOT_SUBMODULE_CLASS.search(cls) and any(
        True for _ in module.parameters()
    )


def _outermost_named(block: nn.Module, predicate: Callable[[nn.Module], bool]) -> Iterator[tuple[str, nn.Module]]:
    def visit(prefix: str, module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if predicate(child):
                yield full, child
            else:
                yield from visit(full, child)

    yield from visit("", block)


def find_final_norms(model: nn.Module, search: BlockSearch) -> tuple[str, ...]:
    """The full name of the per-position norm that runs on the last block's output, as a tuple of zero or one: the
    first direct child of the blocks' container's parent registered after the container that `find_norms` accepts
    (``model.norm`` of Llama, ``transformer.ln_f`` of GPT-2, ``gpt_neox.final_layer_norm``; Gemma 3n's later
    ``per_layer_projection_norm`` is not it). Empty when the blocks came from a regular expression or the container
    is the model itself."""
    if search.method == "block_pattern" and search.container not in dict(model.named_modules()):
        return ()
    parent_name, _, leaf = search.container.rpartition(".")
    if not leaf:
        return ()
    parent = dict(model.named_modules()).get(parent_name)
    if parent is None:
        return ()
    children = [name for name, _ in parent.named_children()]
    if leaf not in children:
        return ()
    after = set(children[children.index(leaf) + 1:])
    prefix = f"{parent_name}." if parent_name else ""
    return tuple(prefix + name for name in find_norms(parent) if name in after)[:1]
