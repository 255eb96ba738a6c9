"""Sequence tiling (``tiled: true``): the MLP runs over chunks of the tokens, each recomputed on its own.

Gradients equal the untiled run's (fp32; to rounding: the weight gradients of a tiled MLP are sums over chunks, not
one matmul over all tokens), the tracked peak stops growing with intermediate size x tokens, MoE blocks are refused,
and the policy key parses from Python, YAML and command-line overrides.
"""

from __future__ import annotations

import types
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from ckpt_models import ARCHS, batch, step_grads, tiny_model
from torch import nn

from remat.checkpointing import CheckpointPolicy, apply_activation_checkpointing, parse_policy
from remat.checkpointing.tiling import default_tile_tokens
from remat.checkpointing.wrappers import is_wrapped, wrap_state
from remat.errors import CheckpointingError, ConfigError
from remat.memory import LiveTensorTracker

DENSE_ARCHS = [arch for arch in ARCHS if arch not in ("mixtral", "qwen3_moe")]
TILE = 5  # 32 tokens (2 x 16) in chunks of 5: uneven, so the last chunk is shorter


def _apply(model: nn.Module, policy: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallback warnings (gemma3n's KV producers) are tested in test_apply
        return apply_activation_checkpointing(model, policy)


def _assert_close_grads(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys() and expected
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], msg=lambda m, n=name: f"{n}: {m}")


def _counting_calls(model: nn.Module, names: list[str]) -> list[int]:
    """Count calls of the original forwards of the tiled modules ``names`` (each chunk is one call)."""
    calls = [0]
    modules = dict(model.named_modules())
    for name in names:
        state = wrap_state(modules[name])
        if state is not None and state.runner.kind == "tiled":
            inner = state.inner

            def counted(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                calls[0] += 1
                return _inner(*args, **kwargs)

            state.inner = counted
    return calls


@pytest.mark.parametrize("mode", ["full", "mlp"])
@pytest.mark.parametrize("arch", DENSE_ARCHS)
def test_tiled_gradients_equal_untiled(arch: str, mode: str) -> None:
    ids = batch()
    expected = step_grads(tiny_model(arch), ids)
    model = tiny_model(arch)
    plan = _apply(model, {"mode": mode, "tiled": True, "tile_tokens": TILE})
    tiled = [name for layer in plan for name in layer.tiled]
    assert tiled and all(is_wrapped(dict(model.named_modules())[n]) for n in tiled)
    assert [n for n, m in model.named_modules() if is_wrapped(m)] == list(plan.wrapped_modules)
    mlps = [name for layer in plan for name in layer.tiled[: len(layer.tiled) - layer.tiled_norms]]
    assert mlps == [f"{layer.name}.{sub}" for layer in plan for sub in ("mlp",)]
    calls = _counting_calls(model, mlps)
    actual = step_grads(model, ids)
    _assert_close_grads(expected, actual)
    chunks = -(-ids.numel() // TILE)
    # Forward + one recompute per chunk; a fully recomputed block adds its own recompute, which runs the chunks
    # again (all of them, or all but the last where checkpoint's early stop ends the block's recompute first).
    full = sum(layer.mode == "full" for layer in plan)
    fewest = len(mlps) * 2 * chunks + full * (chunks - 1)
    assert fewest <= calls[0] <= fewest + full


@pytest.mark.parametrize("policy", [
    {"mode": "selective", "tiled": True, "tile_tokens": TILE},
    {"mode": "attention", "tiled": True, "tile_tokens": TILE},
    {"mode": "offload", "tiled": True, "tile_tokens": TILE},
    {"mode": "full", "tiled": True, "offload": True, "tile_tokens": TILE},
    {"mode": "full", "every_n_layers": 2, "tiled": True, "tile_tokens": TILE},
    {"mode": "full", "segments": 2, "tiled": True, "tile_tokens": TILE},
    {"mode": "full", "tiled": True, "layers": {"1": "selective", "3": "none"}},
    {"mode": "full", "tiled": True},  # default chunk: 32 tokens (the hidden size), one chunk here
])
def test_tiling_composes_with_every_mode(policy: dict[str, Any]) -> None:
    ids = batch()
    expected = step_grads(tiny_model("llama"), ids)
    model = tiny_model("llama")
    plan = _apply(model, policy)
    treated = [layer.index for layer in plan if layer.mode != "none"]
    assert [layer.index for layer in plan if layer.tiled] == treated
    _assert_close_grads(expected, step_grads(model, ids))


def test_dropout_inside_the_mlp_is_replayed_per_chunk() -> None:
    """gpt2's MLP ends in dropout (p=0.1). Reference: the same chunks run without any recompute, so the masks are
    drawn in the same order; if a recompute drew new masks, the gradients would differ."""
    ids = batch()
    reference = tiny_model("gpt2")
    for block in reference.transformer.h:
        mlp_forward = block.mlp.forward

        def chunked(self: nn.Module, hidden: torch.Tensor, _forward: Any = mlp_forward) -> torch.Tensor:
            flat = hidden.reshape(-1, hidden.shape[-1])
            return torch.cat([_forward(c) for c in flat.split(TILE)]).reshape(hidden.shape)

        block.mlp.forward = types.MethodType(chunked, block.mlp)
    expected = step_grads(reference, ids, seed=7)
    assert any(not torch.equal(expected[k], v) for k, v in step_grads(reference, ids, seed=8).items())
    model = tiny_model("gpt2")
    _apply(model, {"mode": "full", "tiled": True, "tile_tokens": TILE})
    _assert_close_grads(expected, step_grads(model, ids, seed=7))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_tiling_a_moe_block_is_refused_in_one_line(arch: str) -> None:
    model = tiny_model(arch)
    with pytest.raises(CheckpointingError, match=r"policy\.tiled: block 0 \(model\.layers\.0, \w+DecoderLayer\) is a "
                       r"mixture-of-experts block") as info:
        _apply(model, {"mode": "full", "tiled": True})
    assert "\n" not in str(info.value)
    assert not any(is_wrapped(m) for m in model.modules())


def test_tiling_applies_to_every_checkpointed_block_of_a_moe_model() -> None:
    model = tiny_model("mixtral")
    with pytest.raises(CheckpointingError, match=r"block 1 \(model\.layers\.1"):
        _apply(model, {"mode": "full", "tiled": True, "layers": {"0": "none"}})


def test_a_non_position_wise_mlp_is_refused_when_called() -> None:
    model = tiny_model("llama")
    _apply(model, {"mode": "mlp", "tiled": True, "tile_tokens": TILE})
    state = wrap_state(model.model.layers[0].mlp)
    assert state is not None
    state.inner = lambda hidden: hidden.sum(0)  # mixes the tokens of the chunk: one row out, not one per token
    with pytest.raises(CheckpointingError, match=r"tiled: model\.layers\.0\.mlp in block 0 \(LlamaMLP\) is not "
                       r"position-wise"):
        model(input_ids=batch(), use_cache=False)


def test_plan_table_shows_the_tiles() -> None:
    plan = _apply(tiny_model("llama"), {"mode": "full", "tiled": True, "tile_tokens": 256,
                                        "layers": {"2": "attention", "3": "none"}})
    rows = plan.rows()
    assert rows[0][4] == "block + mlp + 2 norms in 256-token tiles"
    assert rows[2][4] == "self_attn + mlp + 2 norms in 256-token tiles"
    assert rows[3][4] == "-"
    assert plan.layers[0].tiled == ("model.layers.0.mlp", "model.layers.0.input_layernorm",
                                    "model.layers.0.post_attention_layernorm")
    assert plan.wrapped_modules[:4] == ("model.layers.0", "model.layers.0.mlp", "model.layers.0.input_layernorm",
                                        "model.layers.0.post_attention_layernorm")  # module order
    assert plan.summary().startswith("full, tiled (256 tokens), per-layer: 2=attention, 3=none: 3/4 blocks")
    assert any(note.startswith("the MLPs and norms of 3 blocks run over chunks of 256 tokens") for note in plan.notes)
    assert "mlp + 2 norms in 256-token tiles" in str(plan)
    auto = _apply(tiny_model("gpt2"), {"mode": "mlp", "tiled": True})
    assert auto.rows()[0][4] == "mlp + 2 norms in hidden-size tiles"
    assert auto.layers[0].tiled == ("transformer.h.0.mlp", "transformer.h.0.ln_1", "transformer.h.0.ln_2")
    assert default_tile_tokens(2048) == 2048


# --- the policy key --------------------------------------------------------------------------------------------


def test_policy_key_from_yaml_python_and_options() -> None:
    text = "distributed:\n  activation_checkpointing: {mode: full, tiled: true, tile_tokens: 256}\n"
    value = yaml.safe_load(text)["distributed"]["activation_checkpointing"]
    policy = parse_policy(value, key="distributed.activation_checkpointing")
    assert policy == CheckpointPolicy(mode="full", tiled=True, tile_tokens=256)
    assert policy.to_dict() == {"mode": "full", "tiled": True, "tile_tokens": 256}
    assert parse_policy(policy.to_dict()) == policy
    assert policy.describe() == "full, tiled (256 tokens)"
    model = tiny_model("llama")
    plan = apply_activation_checkpointing(model, "full", tiled=True)
    assert plan.policy.to_dict() == {"mode": "full", "tiled": True}
    assert all(layer.tiled[0] == f"{layer.name}.mlp" and layer.tile_tokens is None for layer in plan)


def test_policy_key_from_a_recipe_override(tmp_path: Path) -> None:
    from remat.recipes.loader import load_recipe

    path = tmp_path / "recipe.yaml"
    path.write_text("model:\n  preset: tiny-llama\nstep_scheduler:\n  global_batch_size: 2\n  local_batch_size: 2\n")
    cfg = load_recipe(path, ["--distributed.activation_checkpointing={mode: full, tiled: true, tile_tokens: 256}"])
    assert cfg.distributed.activation_checkpointing == CheckpointPolicy(mode="full", tiled=True, tile_tokens=256)


@pytest.mark.parametrize(("value", "message"), [
    ({"mode": "none", "tiled": True}, r"k\.tiled: mode 'none' treats no block, so nothing would be tiled; .*"
                                      r"write \{mode: mlp, tiled: true\}"),
    ({"mode": "full", "tile_tokens": 256}, r"k\.tile_tokens: got 256 without tiled: true"),
    ({"mode": "full", "tiled": True, "tile_tokens": 0}, r"k\.tile_tokens: got 0; allowed: an integer >= 1"),
    ({"mode": "full", "tiled": "yes"}, r"k\.tiled: got 'yes'; allowed: true or false"),
    ({"mode": "full", "tiled": True, "tile_token": 5}, r"k: unknown key 'tile_token'.*did you mean 'tile_tokens'"),
])
def test_policy_mistakes_are_named(value: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_policy(value, key="k")


# --- memory ----------------------------------------------------------------------------------------------------


def _tracked_peak(intermediate: int, tokens: int, policy: Any) -> int:
    """The exact tracked peak of one forward+backward of a 2-block llama (hidden 32) over ``tokens`` tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=tokens,
    )
    model = AutoModelForCausalLM.from_config(config).train()
    _apply(model, policy)
    ids = torch.randint(0, 64, (1, tokens))
    with LiveTensorTracker(module=model) as tracker:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return tracker.peak_bytes


def test_tiled_peak_does_not_grow_with_intermediate_times_tokens() -> None:
    """From 256 to 512 tokens the tiled peak grows by the same bytes whatever the intermediate size. The untiled
    peak grows by more: six fp32 [256, intermediate] tensors (the MLP's recomputed gate, up, activation and product
    and the two gradients alive together in its backward) and, for each of the two RMSNorms, the [256, hidden]
    product and [256, 1] reciprocal root it keeps for backward; less the [256, hidden] input gradient the tiled MLP
    gathers from its chunks. Without tiling the norms (measured before they were) the difference lacked the norm
    terms: 256 x (6 x intermediate - hidden) x 4."""
    tiled = {"mode": "full", "tiled": True, "tile_tokens": 64}
    hidden, fp32, more_tokens = 32, 4, 256
    growth = {}
    for intermediate in (1024, 2048):
        untiled_growth = _tracked_peak(intermediate, 512, "full") - _tracked_peak(intermediate, 256, "full")
        tiled_growth = _tracked_peak(intermediate, 512, tiled) - _tracked_peak(intermediate, 256, tiled)
        mlp, norms, gathered = 6 * intermediate, 2 * (hidden + 1), hidden
        assert untiled_growth - tiled_growth == more_tokens * (mlp + norms - gathered) * fp32
        growth[intermediate] = tiled_growth
    assert growth[1024] == growth[2048] < more_tokens * 1024 * fp32
    segment = {"mode": "full", "segments": 1, "tiled": True, "tile_tokens": 64}  # the segment's replay is tiled too
    assert _tracked_peak(1024, 512, segment) - _tracked_peak(1024, 256, segment) < more_tokens * 1024 * fp32


def test_only_per_position_norms_are_tiled() -> None:
    from remat.checkpointing.discovery import find_norms

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(8)
            self.ln_2d = nn.LayerNorm((4, 8))  # normalises over two dimensions: mixes positions
            self.group_norm = nn.GroupNorm(2, 8)  # mixes positions
            self.rms = nn.RMSNorm(8)
            self.mlp = nn.Linear(8, 8)

    assert find_norms(Block()) == ("ln", "rms")
