"""What to recompute: the `CheckpointPolicy` value and `parse_policy`, which accepts every spelling a user may write.

A policy is plain data. It says which mode each transformer block gets (``full``, ``selective``, ``attention``,
``mlp``, ``offload`` or ``none``), whether only one block in N is treated (``every_n_layers``), whether blocks are
recomputed in segments (``segments``), whether what is kept goes to host memory (``offload``), per-layer exceptions
(``layers``), whether MLPs and norms run over chunks of the sequence (``tiled``, ``tile_tokens``) and, for custom
models, where the blocks are (``block_pattern``). Where the blocks are and how they are wrapped is decided
elsewhere (`remat.checkpointing.discovery`, `remat.checkpointing.apply`).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, cast, get_args

from remat.errors import ConfigError

Mode = Literal["full", "none", "selective", "attention", "mlp", "offload"]
MODES: Final[tuple[str, ...]] = get_args(Mode)
#: Strings accepted as a whole policy: the modes plus ``sqrt`` (full checkpointing in segments of ~sqrt(L) blocks).
POLICY_STRINGS: Final[tuple[str, ...]] = (*MODES, "sqrt")
#: The value asking the planner (`remat.planner`) to choose a per-layer policy under a memory budget.
AUTO: Final[str] = "auto"
#: Keys of a policy mapping.
POLICY_KEYS: Final[tuple[str, ...]] = (
    "mode", "every_n_layers", "segments", "offload", "layers", "block_pattern", "tiled", "tile_tokens",
)
#: Keys of one entry of ``layers`` when it is a mapping.
LAYER_KEYS: Final[tuple[str, ...]] = ("mode", "offload")

_LAYER_KEY = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
# The name error messages give the policy while it is validated: the caller's key (e.g.
# ``distributed.activation_checkpointing``) inside `parse_policy`, the class name otherwise.
_ERROR_KEY: ContextVar[str] = ContextVar("remat_policy_error_key", default="CheckpointPolicy")


@dataclass(frozen=True)
class LayerOverride:
    """A per-layer exception: blocks ``first`` to ``last`` (inclusive, 0-based) get ``mode`` (and ``offload``)."""

    first: int
    last: int
    mode: Mode
    offload: bool = False

    def __post_init__(self) -> None:
        key = f"{_ERROR_KEY.get()}.layers"
        for name, value in (("first", self.first), ("last", self.last)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{key}: LayerOverride.{name} got {value!r}; allowed: an integer >= 0")
        if self.last < self.first:
            raise ConfigError(f"{key}: the range {self.first}-{self.last} ends before it starts")
        _check_mode(self.mode, f"{key}.{self.key}.mode")
        _check_bool(self.offload, f"{key}.{self.key}.offload")

    def covers(self, index: int) -> bool:
        """True when block ``index`` is in this override's range."""
        return self.first <= index <= self.last

    @property
    def key(self) -> str:
        """The range as written in a policy mapping: ``"7"`` or ``"0-3"``."""
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


@dataclass(frozen=True)
class CheckpointPolicy:
    """Which activations to recompute, for every block of a model. Build one directly or with `parse_policy`.

    - ``mode``: what each block gets: ``full`` (recompute the block, keep its inputs), ``selective`` (op level: keep
      expensive results, recompute cheap ones), ``attention`` / ``mlp`` (recompute only that sub-module), ``offload``
      (no recompute; what the block saves is kept in host memory), ``none``.
    - ``every_n_layers``: apply ``mode`` to blocks 0, N, 2N, ...; the others keep their activations.
    - ``segments``: recompute consecutive groups of blocks as one unit, keeping only each group's input; an int is
      the number of groups, ``"sqrt"`` means about sqrt(L) groups of about sqrt(L) blocks. Needs ``mode="full"``.
    - ``offload``: also keep what checkpointing keeps (the block inputs) in host memory.
    - ``layers``: per-layer exceptions, which win over ``mode`` and ``every_n_layers``.
    - ``block_pattern``: where the blocks are, for models remat cannot search: a module path (``"encoder.blocks"``,
      whose children are the blocks) or a regular expression matched against full module names.
    - ``tiled``: run the MLP and norms of every treated block over chunks of the tokens, each chunk recomputed on
      its own in backward, so no ``[tokens, intermediate]`` tensor exists whole (see `remat.checkpointing.tiling`);
      combines with every mode but ``none``. ``tile_tokens``: tokens per chunk (default: the model's hidden size).
    """

    mode: Mode = "full"
    every_n_layers: int = 1
    segments: int | Literal["sqrt"] | None = None
    offload: bool = False
    layers: tuple[LayerOverride, ...] = ()
    block_pattern: str | None = None
    tiled: bool = False
    tile_tokens: int | None = None

    def __post_init__(self) -> None:
        key = _ERROR_KEY.get()
        _check_mode(self.mode, f"{key}.mode")
        _check_positive_int(self.every_n_layers, f"{key}.every_n_layers")
        if self.segments is not None and self.segments != "sqrt":
            _check_positive_int(self.segments, f"{key}.segments", allowed="an integer >= 1, or 'sqrt'")
        _check_bool(self.offload, f"{key}.offload")
        if self.block_pattern is not None:
            _check_block_pattern(self.block_pattern, f"{key}.block_pattern")
        _check_bool(self.tiled, f"{key}.tiled")
        if self.tile_tokens is not None:
            _check_positive_int(self.tile_tokens, f"{key}.tile_tokens")
        _check_no_overlap(self.layers, f"{key}.layers")
        _check_combination(self, key)

    @property
    def enabled(self) -> bool:
        """False when the policy checkpoints nothing at all (``none`` without any per-layer exception)."""
        return self.mode != "none" or any(o.mode != "none" for o in self.layers)

    def override_for(self, index: int) -> LayerOverride | None:
        """The per-layer exception covering block ``index``, if any."""
        return next((o for o in self.layers if o.covers(index)), None)

    def to_dict(self) -> dict[str, Any]:
        """A mapping that `parse_policy` turns back into an equal policy (default fields left out)."""
        out: dict[str, Any] = {"mode": self.mode}
        if self.every_n_layers != 1:
            out["every_n_layers"] = self.every_n_layers
        if self.segments is not None:
            out["segments"] = self.segments
        if self.offload:
            out["offload"] = True
        if self.layers:
            out["layers"] = {
                o.key: ({"mode": o.mode, "offload": True} if o.offload else o.mode) for o in self.layers
            }
        if self.block_pattern is not None:
            out["block_pattern"] = self.block_pattern
        if self.tiled:
            out["tiled"] = True
        if self.tile_tokens is not None:
            out["tile_tokens"] = self.tile_tokens
        return out

    def describe(self) -> str:
        """A short human description, e.g. ``"full, every 2nd block, inputs offloaded"``."""
        if not self.enabled:
            return "none"
        parts = [self.mode]
        if self.segments is not None:
            parts.append(f"segments={self.segments}")
        if self.every_n_layers != 1:
            parts.append(f"every {_ordinal(self.every_n_layers)} block")
        if self.offload and self.mode != "offload":
            parts.append("inputs offloaded")
        if self.tiled:
            parts.append(f"tiled ({self.tile_tokens or 'auto'} tokens)")
        if self.layers:
            parts.append("per-layer: " + ", ".join(f"{o.key}={o.mode}" for o in self.layers))
        return ", ".join(parts)


class CarriesPolicy(Protocol):
    """A value that carries a policy, e.g. the planner's `remat.planner.ActivationPlan`."""

    @property
    def checkpoint_policy(self) -> CheckpointPolicy: ...


PolicyLike = CheckpointPolicy | CarriesPolicy | bool | str | Mapping[str, Any] | None


def parse_policy(value: PolicyLike, *, key: str = "policy") -> CheckpointPolicy:
    """Turn any accepted spelling of a policy into a `CheckpointPolicy`, or raise `ConfigError` naming ``key``.

    Accepted: a `CheckpointPolicy`, or an object carrying one as ``checkpoint_policy`` (the planner's
    `remat.planner.ActivationPlan`); ``True`` (full) / ``False`` / ``None`` (none); one of the strings in
    `POLICY_STRINGS`; a mapping with keys from `POLICY_KEYS`, e.g. ``{"mode": "full", "every_n_layers": 2}`` or
    ``{"mode": "selective", "layers": {"0-3": "full", "7": "none"}}``.
    """
    if isinstance(value, CheckpointPolicy):
        return value
    planned = getattr(value, "checkpoint_policy", None)
    if isinstance(planned, CheckpointPolicy):  # a plan that carries its policy (`remat.planner.ActivationPlan`)
        return planned
    if value is None or isinstance(value, bool):
        return _build(key, mode="full" if value else "none")
    if isinstance(value, str):
        if value.strip().lower() == AUTO:
            raise ConfigError(f"{key}: 'auto' is chosen by the planner before anything is built: `remat finetune` "
                              "and `remat plan` plan it in a recipe (with its memory_budget); in Python "
                              "call remat.plan_activation_checkpointing(...) and pass its plan here")
        return _build(key, **_parse_string(value, key))
    if isinstance(value, Mapping):
        return _build(key, **_parse_mapping(value, key))
    raise ConfigError(
        f"{key}: got {value!r} of type {type(value).__name__}; allowed: true, false, one of "
        f"{_listing(POLICY_STRINGS)}, or a mapping with keys {_listing(POLICY_KEYS)}"
    )


def merge_options(policy: CheckpointPolicy, options: Mapping[str, Any], *, key: str = "options") -> CheckpointPolicy:
    """``policy`` with the fields named in ``options`` replaced (same keys and spellings as a policy mapping)."""
    if not options:
        return policy
    merged = policy.to_dict()
    for name, value in options.items():
        if name not in POLICY_KEYS:
            raise ConfigError(_unknown_key_message(key, name, POLICY_KEYS))
        merged[name] = value
    if "segments" in options and "every_n_layers" not in options:
        merged.pop("every_n_layers", None)
    return parse_policy(merged, key=key)


def segment_count(segments: int | Literal["sqrt"], num_blocks: int) -> int:
    """The number of segments for ``num_blocks`` blocks: ``"sqrt"`` gives round(sqrt(L)), at least 1."""
    if segments == "sqrt":
        return max(1, round(math.sqrt(num_blocks)))
    return segments


def split_into_segments(num_blocks: int, count: int) -> list[range]:
    """Consecutive, nearly equal ranges covering ``range(num_blocks)``; the first ones are longer by one."""
    size, extra = divmod(num_blocks, count)
    out, start = [], 0
    for i in range(count):
        stop = start + size + (1 if i < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


# --- parsing -----------------------------------------------------------------------------------------------------


def _build(key: str, **fields: Any) -> CheckpointPolicy:
    with _errors_named(key):
        return CheckpointPolicy(**fields)


@contextmanager
def _errors_named(key: str) -> Iterator[None]:
    token = _ERROR_KEY.set(key)
    try:
        yield
    finally:
        _ERROR_KEY.reset(token)


def _parse_string(value: str, key: str) -> dict[str, Any]:
    text = value.strip().lower()
    if text == "sqrt":
        return {"mode": "full", "segments": "sqrt"}
    if text in MODES:
        return {"mode": text}
    raise ConfigError(
        f"{key}: got {value!r}; allowed: true, false, {_listing(POLICY_STRINGS)}{_suggest(text, POLICY_STRINGS)}"
    )


def _parse_mapping(value: Mapping[str, Any], key: str) -> dict[str, Any]:
    for name in value:
        if name not in POLICY_KEYS:
            raise ConfigError(_unknown_key_message(key, name, POLICY_KEYS))
    fields: dict[str, Any] = {}
    mode = value.get("mode", "full")
    if isinstance(mode, str) and mode.strip().lower() == "sqrt":
        raise ConfigError(f"{key}.mode: got 'sqrt'; in a mapping write 'mode: full' with 'segments: sqrt'")
    fields["mode"] = _mode_from(mode, f"{key}.mode")
    if "every_n_layers" in value:
        fields["every_n_layers"] = value["every_n_layers"]
    if "segments" in value and value["segments"] is not None:
        segments = value["segments"]
        fields["segments"] = segments.strip().lower() if isinstance(segments, str) else segments
    if "offload" in value:
        fields["offload"] = value["offload"]
    if "layers" in value and value["layers"] is not None:
        fields["layers"] = _parse_layers(value["layers"], f"{key}.layers")
    if "block_pattern" in value:
        fields["block_pattern"] = value["block_pattern"]
    for name in ("tiled", "tile_tokens"):
        if name in value:
            fields[name] = value[name]
    return fields


def _parse_layers(value: Any, key: str) -> tuple[LayerOverride, ...]:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{key}: got {value!r}; allowed: a mapping from a layer index or range to a mode, "
            "e.g. {'0-3': 'selective', '7': 'none'}"
        )
    overrides = []
    for raw_key, spec in value.items():
        first, last = _layer_range(raw_key, key)
        entry_key = f"{key}.{raw_key}"
        offload = False
        if isinstance(spec, Mapping):
            for name in spec:
                if name not in LAYER_KEYS:
                    raise ConfigError(_unknown_key_message(entry_key, name, LAYER_KEYS))
            mode = _mode_from(spec.get("mode", "full"), f"{entry_key}.mode")
            offload = spec.get("offload", False)
            _check_bool(offload, f"{entry_key}.offload")
        else:
            mode = _mode_from(spec, entry_key)
        overrides.append(LayerOverride(first, last, mode, offload))
    return tuple(sorted(overrides, key=lambda o: o.first))


def _layer_range(raw_key: Any, key: str) -> tuple[int, int]:
    if isinstance(raw_key, int) and not isinstance(raw_key, bool) and raw_key >= 0:
        return raw_key, raw_key
    match = _LAYER_KEY.match(raw_key) if isinstance(raw_key, str) else None
    if match is None:
        raise ConfigError(
            f"{key}: got the key {raw_key!r}; allowed: a layer index such as '7' or an inclusive range such as '0-3'"
        )
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) is not None else first
    if last < first:
        raise ConfigError(f"{key}: got the range {raw_key!r}, which ends before it starts; write '{last}-{first}'")
    return first, last


def _mode_from(value: Any, key: str) -> Mode:
    if isinstance(value, bool):
        return "full" if value else "none"
    if isinstance(value, str) and value.strip().lower() in MODES:
        return cast(Mode, value.strip().lower())
    hint = _suggest(value.strip().lower(), MODES) if isinstance(value, str) else ""
    raise ConfigError(f"{key}: got {value!r}; allowed: {_listing(MODES)} (or true / false){hint}")


# --- validation --------------------------------------------------------------------------------------------------


def _check_mode(value: Any, key: str) -> None:
    if value not in MODES:
        raise ConfigError(f"{key}: got {value!r}; allowed: {_listing(MODES)}{_suggest(str(value), MODES)}")


def _check_positive_int(value: Any, key: str, *, allowed: str = "an integer >= 1") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: got {value!r}; allowed: {allowed}")


def _check_bool(value: Any, key: str) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: got {value!r}; allowed: true or false")


def _check_block_pattern(value: Any, key: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(
            f"{key}: got {value!r}; allowed: a module path such as 'model.layers' or a regular expression"
        )
    try:
        re.compile(value)
    except re.error as exc:
        raise ConfigError(f"{key}: {value!r} is not a valid regular expression ({exc})") from None


def _check_no_overlap(layers: tuple[LayerOverride, ...], key: str) -> None:
    ordered = sorted(layers, key=lambda o: o.first)
    for before, after in zip(ordered, ordered[1:]):
        if after.first <= before.last:
            raise ConfigError(f"{key}: the ranges {before.key!r} and {after.key!r} overlap; each layer may appear once")


def _check_combination(policy: CheckpointPolicy, key: str) -> None:
    if policy.segments is not None:
        if policy.mode != "full":
            raise ConfigError(
                f"{key}.segments: segments recompute whole blocks, so they need mode 'full'; got mode {policy.mode!r}"
            )
        if policy.every_n_layers != 1:
            raise ConfigError(
                f"{key}: every_n_layers={policy.every_n_layers} and segments={policy.segments!r} both choose which "
                "blocks are recomputed; give one of them"
            )
        if policy.layers:
            raise ConfigError(f"{key}: per-layer exceptions (layers) cannot be combined with segments")
        if policy.offload:
            raise ConfigError(f"{key}: offload cannot be combined with segments; use every_n_layers or full instead")
    if policy.mode == "none" and policy.every_n_layers != 1:
        raise ConfigError(
            f"{key}.every_n_layers: got {policy.every_n_layers} with mode 'none', which checkpoints nothing"
        )
    if policy.mode == "none" and policy.offload:
        raise ConfigError(f"{key}.offload: mode 'none' keeps activations in place; to offload them use mode 'offload'")
    _check_tiling(policy, key)
    for override in policy.layers:
        if override.mode == "none" and override.offload:
            raise ConfigError(f"{key}.layers.{override.key}.offload: mode 'none' with offload; use mode 'offload'")


def _check_tiling(policy: CheckpointPolicy, key: str) -> None:
    if policy.tile_tokens is not None and not policy.tiled:
        raise ConfigError(f"{key}.tile_tokens: got {policy.tile_tokens} without tiled: true; add tiled: true")
    if policy.tiled and not policy.enabled:
        raise ConfigError(
            f"{key}.tiled: mode 'none' treats no block, so nothing would be tiled; tiling recomputes each MLP "
            "chunk by chunk, so for tiled MLPs without recomputing whole blocks write {mode: mlp, tiled: true}"
        )


# --- messages ----------------------------------------------------------------------------------------------------


def _listing(values: tuple[str, ...]) -> str:
    return ", ".join(values)


def _suggest(value: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(value, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _unknown_key_message(key: str, name: Any, allowed: tuple[str, ...]) -> str:
    return f"{key}: unknown key {name!r}; allowed keys: {_listing(allowed)}{_suggest(str(name), allowed)}"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
