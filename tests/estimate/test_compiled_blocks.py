"""Compiled blocks in the estimate and the planner (`remat.estimate.compiled`): what a simulated compiled block
keeps for backward is what inductor's real compiled block saves, mode by mode; the simulated step and the planner's
block measurements agree; a recipe that compiles its blocks is planned with less recompute than its eager twin."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny import TINY_LLAMA_PRESET, tiny_recipe

from remat.checkpointing import CheckpointPolicy, apply_activation_checkpointing
from remat.checkpointing.discovery import find_blocks
from remat.estimate.api import estimate_of_trace, recipe_step
from remat.estimate.compiled import EAGER_FALLBACK_NOTE
from remat.estimate.settings import report_settings
from remat.estimate.simulate import simulate_step
from remat.planner.api import plan_recipe
from remat.planner.measure import measure_blocks
from remat.recipes.build import build_recipe_model
from remat.recipes.loader import validate_recipe

pytestmark = pytest.mark.slow

SHAPE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}


def _recipe(compile_: dict[str, Any] | None = None, **sections: Any) -> Any:
    model = {**TINY_LLAMA_PRESET, "config": SHAPE}  # document attention on, rows of one document each
    return validate_recipe(tiny_recipe(model=model, dataset={"seq_length": 64},
                                       compile=compile_ or {"enabled": False}, **sections))


def _saved_by_inductor(mode: str, **sections: Any) -> int:
    """Bytes block 0 of the recipe's real model, compiled by inductor as `compile_blocks` compiles it, saves for
    backward under ``mode``: every storage autograd's saved-tensor hooks see, less the parameters, the block's
    inputs and its output (the planner's `ModeCost.kept_bytes` counts the same)."""
    recipe = _recipe(**sections)
    torch.manual_seed(0)
    model = build_recipe_model(recipe, vocab_size=None)
    apply_activation_checkpointing(model, CheckpointPolicy(mode=mode))
    block = find_blocks(model).blocks[0].module
    calls: list[tuple[Any, Any]] = []
    handle = block.register_forward_pre_hook(lambda _m, args, kwargs: calls.append((args, kwargs)) or None,
                                             with_kwargs=True)
    ids = torch.randint(0, 200, (2, 64))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    handle.remove()
    args, kwargs = calls[0]
    hidden = args[0].detach().requires_grad_() if args else kwargs["hidden_states"].detach().requires_grad_()
    args, kwargs = ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})
    known = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for value in (*args, *kwargs.values()):
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, torch.Tensor):
                known.add(item.untyped_storage().data_ptr())
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in known:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    torch._dynamo.reset()
    block.compile(backend="inductor")
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = block(*args, **kwargs)
    output = output[0] if isinstance(output, tuple) else output
    saved.pop(output.untyped_storage().data_ptr(), None)
    torch._dynamo.reset()
    return sum(saved.values())


@pytest.fixture(scope="module")
def kinds() -> dict[bool, Any]:
    """The planner's measurement of the block, compiled (True) and eager (False)."""
    out = {}
    for compiled in (True, False):
        recipe, run = recipe_step(_recipe({"enabled": compiled}), target="cpu")
        out[compiled] = measure_blocks(recipe, run).kinds[0]
    return out


@pytest.mark.parametrize("mode", ["none", "mlp", "selective", "full"])
def test_a_simulated_compiled_block_keeps_what_inductors_compiled_block_saves(mode: str, kinds: dict[bool, Any]
                                                                              ) -> None:
    measured, eager = kinds[True].cost(mode).kept_bytes, kinds[False].cost(mode).kept_bytes
    assert measured == _saved_by_inductor(mode)
    if mode != "full":  # full keeps the block's input either way (and inductor's RNG state for the recompute)
        assert measured < eager


LORA: dict[str, Any] = {"method": "lora", "r": 4, "lora_alpha": 8.0, "lora_dropout": 0.1,
                        "target_modules": ["q_proj", "v_proj"]}
"""LoRA with dropout: inductor's joint-graph passes replace its random ops (seeds made in inductor's fake mode)."""


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_a_compiled_lora_block_with_dropout_keeps_what_inductor_saves(mode: str) -> None:
    recipe, run = recipe_step(_recipe({"enabled": True}, peft=LORA), target="cpu")
    measured = measure_blocks(recipe, run).kinds[0].cost(mode).kept_bytes  # type: ignore[arg-type]
    assert measured == _saved_by_inductor(mode, peft=LORA)


def _step(policy: str, compile_: dict[str, Any] | None = None, distributed_extra: dict[str, Any] | None = None,
          **sections: Any) -> Any:
    distributed = {"activation_checkpointing": policy, **(distributed_extra or {})}
    recipe, run = recipe_step(_recipe(compile_, distributed=distributed, **sections), target="cpu")
    return estimate_of_trace(simulate_step(recipe, run, blocks=True), report_settings(recipe, run), model="tiny")


def test_the_simulated_step_holds_what_the_planner_measured_per_block(kinds: dict[bool, Any]) -> None:
    """The activations the whole compiled step holds when its backward starts differ from the eager step's by the
    blocks' kept bytes as measured one block at a time, compiled and eager."""
    compiled_kept, eager_kept = kinds[True].cost("none").kept_bytes, kinds[False].cost("none").kept_bytes
    compiled, eager = _step("none", {"enabled": True}), _step("none")
    blocks = SHAPE["num_hidden_layers"]
    saved = eager.breakdown["activations"] - compiled.breakdown["activations"]
    assert compiled.phase == eager.phase and eager.phase.startswith("backward")
    assert saved == blocks * (eager_kept - compiled_kept) > 0
    assert compiled.peak_bytes < eager.peak_bytes
    assert any(note.startswith("compile: the blocks are simulated compiled (inductor's") for note in compiled.notes)


def test_a_recipe_that_compiles_its_blocks_is_planned_with_less_recompute() -> None:
    budget = _step("mlp").peak_bytes  # eager blocks need mlp or selective on every block to fit this
    eager = plan_recipe(_recipe(), budget=budget, target="cpu")
    compiled = plan_recipe(_recipe({"enabled": True}), budget=budget, target="cpu")
    assert eager.peak_bytes <= budget and compiled.peak_bytes <= budget
    assert compiled.recompute_flops < eager.recompute_flops
    assert any(note.startswith("compile: the blocks are simulated compiled") for note in compiled.notes)


def test_blocks_dynamo_runs_eagerly_are_simulated_eager_and_said_so() -> None:
    """Packed rows of several documents with document attention break the graph inside the checkpointed region,
    where dynamo cannot resume (docs/models.md): under ``full`` the run's blocks then run eagerly, and so do the
    simulation's."""
    packed = {**TINY_LLAMA_PRESET, "config": SHAPE}

    def estimate(compile_: dict[str, Any]) -> Any:
        recipe, run = recipe_step(validate_recipe(tiny_recipe(
            model=packed, dataset={"seq_length": 64}, compile=compile_,
            distributed={"activation_checkpointing": "full"})), target="cpu", documents_per_row=4)
        return estimate_of_trace(simulate_step(recipe, run), report_settings(recipe, run), model="tiny")

    compiled, eager = estimate({"enabled": True}), estimate({"enabled": False})
    assert compiled.peak_bytes == eager.peak_bytes
    assert EAGER_FALLBACK_NOTE in compiled.notes


def test_compiled_blocks_are_simulated_under_fsdp2_too() -> None:
    sharded = {"strategy": "fsdp2", "dp_size": 2}
    compiled = _step("none", {"enabled": True}, distributed_extra=sharded)
    eager = _step("none", distributed_extra=sharded)
    assert compiled.peak_bytes < eager.peak_bytes
    assert any(note.startswith("compile: the blocks are simulated compiled") for note in compiled.notes)


def test_compiled_blocks_that_cannot_run_on_fake_tensors_are_simulated_eager_and_said_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """E.g. a tensor-parallel block under ``full`` on torch 2.13: AOTAutograd's runtime refuses the device mesh the
    partitioned graph saves. The step is simulated again with eager blocks (an upper bound), in a note."""
    from remat.estimate.compiled import SimulatedCompile

    def failing(self: Any, graph: Any, _inputs: Any) -> Any:
        def run(args: list[Any]) -> Any:
            raise AssertionError("expected all tensors_saved_with_vc_check to be Tensors")
        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    monkeypatch.setattr(SimulatedCompile, "_interpreted", failing)
    compiled, eager = _step("full", {"enabled": True}), _step("full")
    assert compiled.peak_bytes == eager.peak_bytes
    assert any(note.startswith("compile: the compiled blocks could not run on the simulation's fake tensors "
                               "(AssertionError: expected all") for note in compiled.notes)
