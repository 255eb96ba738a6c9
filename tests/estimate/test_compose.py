"""Composed traces (`remat.estimate.compose`) are the simulated ones: a per-block mix of modes composed from the
uniform policies' traces replays to the same peak, phase peaks, breakdown and reserved bytes as its own simulation,
on the CUDA and exact allocator models, for single-process and FSDP2 steps, the plain and the fused loss, and
gradient accumulation, float32 and bfloat16. Where the traces cannot settle a tensor's lifetime, composition
declines (None), never guesses."""

from __future__ import annotations

from typing import Any

import pytest

from remat.checkpointing import CheckpointPolicy
from remat.estimate.compose import compose, parse
from remat.estimate.replay import replay
from remat.estimate.run import SimulatedRun
from remat.estimate.simulate import simulate_step
from remat.planner.choose import policy_of
from remat.recipes.loader import validate_recipe
from tiny import tiny_recipe

TINY = {"preset": "tiny-llama", "config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                                           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}}
MODES = ("none", "attention", "mlp", "selective", "full")
MIXES = [("full", "none", "full", "none"), ("mlp", "full", "selective", "attention")]


def _recipe(strategy: str = "single", world: int = 1, *, fused: bool = False, accumulation: int = 1,
            dtype: str | None = None) -> Any:
    model = {**TINY, "dtype": dtype} if dtype else TINY
    return validate_recipe(tiny_recipe(
        model=model, dataset={"seq_length": 64},
        step_scheduler={"global_batch_size": 2 * world * accumulation, "local_batch_size": 2},
        distributed={"strategy": strategy}, **({"loss_fn": {"_target_": "remat.loss.FusedLinearCrossEntropy"}}
                                               if fused else {})))


def _replays(trace: Any) -> list[Any]:
    return [replay(trace.events, trace.marks, kind=kind, steady_state=steady)
            for kind in ("cuda", "exact") for steady in (True, False)]


def _sources(recipe: Any, run: SimulatedRun) -> list[Any]:
    return [parse(simulate_step(recipe.with_checkpointing(CheckpointPolicy(mode=mode)), run, blocks=True))
            for mode in MODES]


def _assert_mixes_compose(recipe: Any, run: SimulatedRun) -> tuple[list[Any], Any]:
    """Every `MIXES` policy composed from the uniform traces replays as its own simulation; returns the sources and
    the last simulated trace."""
    sources = _sources(recipe, run)
    for modes in MIXES:
        simulated = simulate_step(recipe.with_checkpointing(policy_of(modes)), run, blocks=True)
        composed = compose(simulated.layers, sources)
        assert composed is not None, modes
        assert _replays(composed) == _replays(simulated), modes
    return sources, simulated


@pytest.mark.parametrize(("strategy", "world", "fused", "target", "accumulation"), [
    ("fsdp2", 2, True, "cuda", 1),
    ("single", 1, False, "cuda", 2),
])
def test_a_composed_mix_replays_as_its_simulation(strategy: str, world: int, fused: bool, target: str,
                                                  accumulation: int) -> None:
    _assert_mixes_compose(_recipe(strategy, world, fused=fused, accumulation=accumulation),
                          SimulatedRun(target=target, world_size=world))


def test_bfloat16_block_outputs_die_where_their_last_holder_lets_go() -> None:
    # bfloat16: the norm saves a float32 copy, so a block output's last holder is the decoder's loop under none and
    # the next block under full; alternating them, each output dies where the next block's trace says
    sources, simulated = _assert_mixes_compose(_recipe(fused=True, dtype="bfloat16"), SimulatedRun(target="cuda"))
    # a block that could hold tensors it was not given (models sharing keys and values between blocks) leaves the
    # lifetime open: composition declines rather than guesses
    sources[0].trace.blocks = None
    assert compose(simulated.layers, sources) is None
    assert compose(sources[MODES.index("full")].trace.layers, sources) is not None  # one trace's own blocks
    assert compose(sources[MODES.index("full")].trace.layers, sources[:1]) is None  # no full trace to draw from


def test_a_step_stopped_where_the_update_starts_composes_into_the_whole_step() -> None:
    recipe = _recipe("fsdp2", 2, fused=True)
    run = SimulatedRun(target="cuda", world_size=2)
    reference = parse(simulate_step(recipe, run, blocks=True))
    full = recipe.with_checkpointing(CheckpointPolicy(mode="full"))
    partial = parse(simulate_step(full, run, blocks=True, stop_at_update=True))
    assert partial.trace.partial and len(partial.keys) < len(reference.keys)
    composed = compose(partial.trace.layers, [reference, partial])
    assert composed is not None
    assert _replays(composed) == _replays(simulate_step(full, run, blocks=True))
    assert compose(partial.trace.layers, [partial, reference]) is None  # a partial step cannot supply the update


def test_a_trace_without_block_boundaries_is_not_a_source() -> None:
    assert parse(simulate_step(_recipe(), SimulatedRun(target="cpu"))) is None
