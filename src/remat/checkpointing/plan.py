"""What was applied: `CheckpointPlan`, one `LayerPlan` per block, printable as a table and as one summary line."""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from remat.checkpointing.policy import CheckpointPolicy, Mode


class CheckpointingWarning(UserWarning):
    """A checkpointing choice was changed or is likely a poor one (a fallback taken, selective on MoE blocks)."""


class MoESelectiveWarning(CheckpointingWarning):
    """Selective checkpointing was asked for mixture-of-experts blocks, where full is the usual choice."""


@contextmanager
def planned_policy(planned: bool = True) -> Iterator[None]:
    """While applying a policy the planner chose (``planned``), drop `MoESelectiveWarning`: the planner gave
    selective to those MoE blocks on measured sizes and said so in its own note, so the generic advice would only
    contradict it."""
    if not planned:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MoESelectiveWarning)
        yield


@dataclass(frozen=True)
class LayerPlan:
    """What one block got.

    ``requested`` is the mode the policy asked for this block (after ``every_n_layers`` and per-layer exceptions),
    ``mode`` what was applied (they differ when a fallback was taken; ``note`` says why). ``wrapped`` lists the full
    names of the modules whose forward runs under checkpointing or offloading: the block itself, its attention or MLP
    sub-modules, or nothing. ``segment`` is the (first, last) block index of the segment recomputed as one unit.
    ``tiled`` lists the wrapped modules that run over chunks of ``tile_tokens`` tokens (None: the default chunk
    length, `remat.checkpointing.tiling.default_tile_tokens`): the MLPs, then the block's ``tiled_norms`` norms.
    """

    index: int
    name: str
    block_type: str
    requested: Mode
    mode: Mode
    wrapped: tuple[str, ...] = ()
    offload: bool = False
    segment: tuple[int, int] | None = None
    note: str = ""
    tiled: tuple[str, ...] = ()
    tiled_norms: int = 0
    tile_tokens: int | None = None

    @property
    def checkpointed(self) -> bool:
        """True when anything in this block is recomputed or offloaded."""
        return self.mode != "none"

    @property
    def recomputes(self) -> str:
        """What backward recomputes for this block, in words (tiled MLPs included)."""
        if not self.tiled:
            return self._recomputes_untiled()
        tiles = f"{self.tile_tokens}-token" if self.tile_tokens else "hidden-size"
        mlps = self.tiled[: len(self.tiled) - self.tiled_norms]
        names = ", ".join(w.rsplit(".", 1)[-1] for w in mlps)
        if self.tiled_norms:
            names += f" + {self.tiled_norms} norm{'s' if self.tiled_norms > 1 else ''}"
        if self.mode == "mlp":
            return f"{names} in {tiles} tiles"
        if self.mode == "attention":
            head = ", ".join(w.rsplit(".", 1)[-1] for w in self.wrapped if w not in self.tiled)
        else:
            head = self._recomputes_untiled()
        return f"{names} in {tiles} tiles" if head == "nothing" else f"{head} + {names} in {tiles} tiles"

    def _recomputes_untiled(self) -> str:
        if self.segment is not None and self.segment[0] != self.segment[1]:
            return f"segment {self.segment[0]}-{self.segment[1]}"
        if self.mode in ("attention", "mlp"):
            return ", ".join(w.rsplit(".", 1)[-1] for w in self.wrapped)
        return {"full": "block", "selective": "cheap ops", "offload": "nothing", "none": "-"}[self.mode]


@dataclass(frozen=True)
class CheckpointPlan:
    """The outcome of `apply_activation_checkpointing`: per block what was applied and why, plus model-wide notes.

    ``str(plan)`` / ``plan.table()`` give a plain-text table, ``plan.rich_table()`` a ``rich`` table, and
    ``plan.summary()`` one line for logs.
    """

    policy: CheckpointPolicy
    model_class: str
    layers: tuple[LayerPlan, ...] = ()
    container: str = ""
    notes: tuple[str, ...] = field(default=())
    #: Modules outside the blocks that run over chunks of the tokens (the final norm, with ``tiled: true``).
    tiled_outside: tuple[str, ...] = ()
    #: The offloading context used by offloading layers (an `OffloadActivations`, whose ``stats`` say what moved).
    offload_context: Any = field(default=None, repr=False, compare=False)

    @classmethod
    def empty(cls, policy: CheckpointPolicy, model_class: str, note: str = "") -> CheckpointPlan:
        """The plan of a policy that checkpoints nothing (``none``)."""
        return cls(policy=policy, model_class=model_class, notes=(note,) if note else ())

    def __iter__(self) -> Iterator[LayerPlan]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def num_blocks(self) -> int:
        """How many blocks the model has (as found by discovery); 0 for an empty plan."""
        return len(self.layers)

    @property
    def num_checkpointed(self) -> int:
        """How many blocks have something recomputed or offloaded."""
        return sum(layer.checkpointed for layer in self.layers)

    @property
    def wrapped_modules(self) -> tuple[str, ...]:
        """Full names of every module whose forward was wrapped, in block order."""
        return tuple(name for layer in self.layers for name in layer.wrapped) + self.tiled_outside

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """The (first, last) block indices of each segment recomputed as one unit, in order."""
        seen = []
        for layer in self.layers:
            if layer.segment is not None and layer.segment not in seen:
                seen.append(layer.segment)
        return tuple(seen)

    def shard_groups(self) -> tuple[tuple[str, ...], ...]:
        """Block names grouped into the units FSDP2 should shard together, in order: one block per unit, except
        that the blocks of a segment form one unit (a segment is replayed as a whole, so all its parameters must be
        gathered when backward reaches its last block). Use ``fully_shard([modules[n] for n in group])``."""
        groups: list[tuple[str, ...]] = []
        for layer in self.layers:
            span = layer.segment
            if span is not None and span[0] != span[1]:
                if layer.index == span[0]:
                    groups.append(tuple(self.layers[i].name for i in range(span[0], span[1] + 1)))
                continue
            groups.append((layer.name,))
        return tuple(groups)

    @property
    def fallbacks(self) -> tuple[LayerPlan, ...]:
        """Blocks that got another mode than the policy asked for."""
        return tuple(layer for layer in self.layers if layer.mode != layer.requested)

    def modes(self) -> dict[str, int]:
        """How many blocks got each applied mode, e.g. ``{"full": 6, "mlp": 2}``."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            counts[layer.mode] = counts.get(layer.mode, 0) + 1
        return counts

    def summary(self) -> str:
        """One line: the policy, how many blocks got what, fallbacks, e.g.
        ``full: 4/4 blocks of LlamaForCausalLM (model.layers); use_cache off``."""
        if not self.layers:
            return f"{self.policy.describe()}: nothing wrapped in {self.model_class}"
        applied = ", ".join(f"{mode} {count}" for mode, count in self.modes().items() if mode != "none")
        text = (
            f"{self.policy.describe()}: {self.num_checkpointed}/{self.num_blocks} blocks of {self.model_class} "
            f"({self.container}) [{applied}]"
        )
        if self.segments:
            text += f", {len(self.segments)} segments"
        if self.fallbacks:
            text += f", {len(self.fallbacks)} fallbacks"
        return text

    def rows(self) -> list[tuple[str, ...]]:
        """The table rows (without header): index, block, type, mode, recomputes, offload, note."""
        return [
            (
                str(layer.index),
                layer.name,
                layer.block_type,
                layer.mode if layer.mode == layer.requested else f"{layer.mode} (asked {layer.requested})",
                layer.recomputes,
                "yes" if layer.offload else "-",
                layer.note,
            )
            for layer in self.layers
        ]

    _HEADER = ("#", "block", "type", "mode", "recomputes", "offload", "note")

    def table(self) -> str:
        """A plain-text table of every block followed by the notes; stable, for logs and tests."""
        rows = [self._HEADER, *self.rows()]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self._HEADER))]
        lines = [self.summary()]
        for n, row in enumerate(rows):
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def rich_table(self) -> Any:
        """The same table as a ``rich.table.Table`` (print it with a rich console)."""
        from rich.table import Table

        table = Table(title=self.summary(), caption="\n".join(self.notes) or None)
        for column in self._HEADER:
            table.add_column(column)
        for row in self.rows():
            table.add_row(*row)
        return table

    def render_rich(self, width: int = 120) -> str:
        """The rich table rendered to text (no colours)."""
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=width, color_system=None).print(self.rich_table())
        return buffer.getvalue()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description: the policy mapping, model class, container, notes and the layers."""
        return {
            "policy": self.policy.to_dict(),
            "model_class": self.model_class,
            "container": self.container,
            "notes": list(self.notes),
            "layers": [asdict(layer) for layer in self.layers],
        }

    def __str__(self) -> str:
        return self.table()
