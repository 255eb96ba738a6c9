"""`parse_policy` accepts every documented spelling and rejects the rest with a message naming key, value and
choices."""

from __future__ import annotations

from typing import Any

import pytest

from remat.checkpointing import CheckpointPolicy, parse_policy
from remat.checkpointing.policy import LayerOverride
from remat.checkpointing.policy import merge_options, segment_count, split_into_segments
from remat.errors import ConfigError

KEY = "distributed.activation_checkpointing"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (True, CheckpointPolicy("full")),
        (False, CheckpointPolicy("none")),
        (None, CheckpointPolicy("none")),
        ("full", CheckpointPolicy("full")),
        (" Selective ", CheckpointPolicy("selective")),
        ("attention", CheckpointPolicy("attention")),
        ("mlp", CheckpointPolicy("mlp")),
        ("offload", CheckpointPolicy("offload")),
        ("none", CheckpointPolicy("none")),
        ("sqrt", CheckpointPolicy("full", segments="sqrt")),
        ({"mode": "full", "every_n_layers": 2}, CheckpointPolicy("full", every_n_layers=2)),
        ({"mode": "selective", "offload": True}, CheckpointPolicy("selective", offload=True)),
        ({"segments": 3}, CheckpointPolicy("full", segments=3)),
        ({"segments": "SQRT"}, CheckpointPolicy("full", segments="sqrt")),
        ({"block_pattern": r"blocks\.\d+"}, CheckpointPolicy("full", block_pattern=r"blocks\.\d+")),
        (
            {"mode": "selective", "layers": {"0-3": "full", 7: "none", "5": {"mode": "mlp", "offload": True}}},
            CheckpointPolicy(
                "selective",
                layers=(LayerOverride(0, 3, "full"), LayerOverride(5, 5, "mlp", True), LayerOverride(7, 7, "none")),
            ),
        ),
        (
            {"layers": {"2": True, "3": False}},
            CheckpointPolicy(layers=(LayerOverride(2, 2, "full"), LayerOverride(3, 3, "none"))),
        ),
    ],
)
def test_accepted_spellings(value: Any, expected: CheckpointPolicy) -> None:
    policy = parse_policy(value, key=KEY)
    assert policy == expected
    assert parse_policy(policy.to_dict()) == policy  # round trip through the mapping form
    assert parse_policy(policy) is policy


@pytest.mark.parametrize(
    ("value", "fragments"),
    [
        ("ful", [f"{KEY}: got 'ful'", "allowed: true, false, full, none, selective, attention, mlp, offload, sqrt",
                 "did you mean 'full'"]),
        (3, [f"{KEY}: got 3 of type int", "a mapping with keys mode, every_n_layers"]),
        ({"mdoe": "full"}, [f"{KEY}: unknown key 'mdoe'", "allowed keys: mode, every_n_layers", "did you mean 'mode'"]),
        ({"mode": "selectiv"}, [f"{KEY}.mode: got 'selectiv'", "did you mean 'selective'"]),
        ({"mode": "sqrt"}, [f"{KEY}.mode: got 'sqrt'", "segments: sqrt"]),
        ({"every_n_layers": 0}, [f"{KEY}.every_n_layers: got 0", "an integer >= 1"]),
        ({"every_n_layers": "2"}, [f"{KEY}.every_n_layers: got '2'"]),
        ({"every_n_layers": True}, [f"{KEY}.every_n_layers: got True"]),
        ({"segments": 0}, [f"{KEY}.segments: got 0", "or 'sqrt'"]),
        ({"segments": "cube"}, [f"{KEY}.segments: got 'cube'"]),
        ({"offload": "yes"}, [f"{KEY}.offload: got 'yes'", "true or false"]),
        ({"segments": 2, "every_n_layers": 2}, [f"{KEY}: every_n_layers=2 and segments=2", "give one of them"]),
        ({"mode": "selective", "segments": 2}, [f"{KEY}.segments", "need mode 'full'", "got mode 'selective'"]),
        ({"segments": 2, "offload": True}, [f"{KEY}: offload cannot be combined with segments"]),
        ({"segments": 2, "layers": {"0": "none"}}, [f"{KEY}: per-layer exceptions (layers) cannot be combined"]),
        ({"mode": "none", "every_n_layers": 2}, [f"{KEY}.every_n_layers: got 2 with mode 'none'"]),
        ({"mode": "none", "offload": True}, [f"{KEY}.offload", "use mode 'offload'"]),
        ({"layers": ["0"]}, [f"{KEY}.layers: got ['0']", "a mapping from a layer index or range"]),
        ({"layers": {"a-b": "full"}}, [f"{KEY}.layers: got the key 'a-b'", "'0-3'"]),
        ({"layers": {"5-2": "full"}}, [f"{KEY}.layers: got the range '5-2'", "write '2-5'"]),
        ({"layers": {"0-3": "full", "2": "none"}}, [f"{KEY}.layers: the ranges '0-3' and '2' overlap"]),
        ({"layers": {"1": "fast"}}, [f"{KEY}.layers.1: got 'fast'"]),
        ({"layers": {"1": {"mode": "full", "every_n_layers": 2}}}, [f"{KEY}.layers.1: unknown key 'every_n_layers'",
                                                                   "allowed keys: mode, offload"]),
        ({"block_pattern": "model.layers.("}, [f"{KEY}.block_pattern: 'model.layers.(' is not a valid regular"]),
        ({"block_pattern": ""}, [f"{KEY}.block_pattern: got ''"]),
    ],
)
def test_rejected_values_name_key_value_and_choices(value: Any, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_policy(value, key=KEY)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_default_key_and_direct_construction_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"^policy: got 'x'"):
        parse_policy("x")
    with pytest.raises(ConfigError, match=r"^CheckpointPolicy\.mode: got 'fast'"):
        CheckpointPolicy(mode="fast")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^CheckpointPolicy\.every_n_layers: got -1"):
        CheckpointPolicy(every_n_layers=-1)
    with pytest.raises(ConfigError, match="ends before it starts"):
        LayerOverride(3, 1, "full")


def test_enabled_describe_and_override_lookup() -> None:
    assert not parse_policy(False).enabled
    assert parse_policy({"mode": "none", "layers": {"2": "full"}}).enabled
    assert parse_policy({"mode": "none", "layers": {"2": "none"}}).enabled is False
    assert parse_policy({"mode": "full", "every_n_layers": 3, "offload": True}).describe() == (
        "full, every 3rd block, inputs offloaded"
    )
    policy = parse_policy({"layers": {"2-4": "mlp"}})
    assert policy.override_for(3) == LayerOverride(2, 4, "mlp")
    assert policy.override_for(5) is None


def test_merge_options_overrides_fields_and_rejects_unknown_ones() -> None:
    base = parse_policy("selective")
    assert merge_options(base, {"every_n_layers": 2}) == CheckpointPolicy("selective", every_n_layers=2)
    assert merge_options(parse_policy({"every_n_layers": 2}), {"segments": "sqrt"}) == CheckpointPolicy(segments="sqrt")
    assert merge_options(base, {}) is base
    with pytest.raises(ConfigError, match="options: unknown key 'every_n'.*did you mean 'every_n_layers'"):
        merge_options(base, {"every_n": 2})


@pytest.mark.parametrize(
    ("blocks", "segments", "sizes"),
    [(4, "sqrt", [2, 2]), (9, "sqrt", [3, 3, 3]), (10, "sqrt", [4, 3, 3]), (32, "sqrt", [6, 6, 5, 5, 5, 5]),
     (4, 3, [2, 1, 1]), (5, 1, [5]), (1, "sqrt", [1])],
)
def test_segments_are_consecutive_and_nearly_equal(blocks: int, segments: Any, sizes: list[int]) -> None:
    ranges = split_into_segments(blocks, segment_count(segments, blocks))
    assert [len(r) for r in ranges] == sizes
    assert [i for r in ranges for i in r] == list(range(blocks))
