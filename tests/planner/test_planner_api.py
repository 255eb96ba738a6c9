"""The planner's parts and entry points: budgets, the frontier (against brute force), placement and policy
spelling, `plan_activation_checkpointing` with `apply_activation_checkpointing`, recipes with ``auto``, the error when
nothing fits, and `remat plan` with --json / --png."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from remat.checkpointing import CheckpointPolicy, apply_activation_checkpointing, parse_policy
from remat.errors import ConfigError
from remat.checkpointing.budget import DEFAULT_MARGIN, parse_budget
from remat.estimate import StepSettings
from remat.models import ModelConfig
from remat.planner import ActivationPlan, Planner, plan_recipe_auto
from remat.planner import plan_activation_checkpointing
from remat.planner.choose import Assignment, assign, cheapest_saving, frontier, policy_of
from remat.planner.measure import BlockKind, BlockMeasurements, ModeCost
from remat.recipes.loader import load_recipe, validate_recipe

GIB = 2**30
#: A small Llama that plans in a few seconds: 4 blocks, hidden 64, vocabulary 512.
SMALL = {"preset": "tiny-llama", "config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                                            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}}


# --- budgets -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "device", "expected"), [
    (40 * GIB, None, 40 * GIB), ("40GiB", None, 40 * GIB), ("24 GB", None, 24 * 10**9), (0.5, 80 * GIB, 40 * GIB),
    ("0.25", 80 * GIB, 20 * GIB), (None, 80 * GIB, int(80 * GIB * (1 - DEFAULT_MARGIN))), ("4194304", None, 2**22),
])
def test_budgets_are_bytes_sizes_or_fractions(value: Any, device: int | None, expected: int) -> None:
    assert parse_budget(value, device_bytes=device) == expected


@pytest.mark.parametrize(("value", "device", "message"), [
    (None, None, r"memory_budget: required here: planning for the CPU"),
    (0.8, None, r"memory_budget: got the fraction 0.8, but no device memory is known"),
    (1.5, 80 * GIB, r"memory_budget: got 1.5; a fraction of the device's memory must be in \(0, 1\]"),
    (80, None, r"memory_budget: got 80 bytes, less than 1 MiB; write a unit \(e.g. 80GiB\)"),
    ("80 gigs", None, r"memory_budget: got '80 gigs'; allowed: a number with a unit"),
    (True, None, r"memory_budget: got True"),
    (10**400, None, r"memory_budget: got a 401-digit number of bytes, more than 1 EiB"),
    (str(10**400), None, r"memory_budget: got a 401-digit number of bytes, more than 1 EiB"),
])
def test_bad_budgets_are_refused_naming_the_key(value: Any, device: int | None, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_budget(value, device_bytes=device)


# --- choosing --------------------------------------------------------------------------------------------------


def _measurements() -> BlockMeasurements:
    """Two kinds of blocks with made-up costs (kept bytes, recompute FLOPs) where no mode dominates all others."""
    a = BlockKind("A", (0, 2, 4), (ModeCost("none", 100, 0, 0), ModeCost("mlp", 60, 30, 0),
                                   ModeCost("selective", 35, 45, 0), ModeCost("full", 0, 100, 0)), flops=300)
    b = BlockKind("B", (1, 3), (ModeCost("none", 80, 0, 0), ModeCost("attention", 50, 10, 0),
                                ModeCost("full", 0, 90, 0)), flops=200)
    return BlockMeasurements(tuple(f"layers.{i}" for i in range(5)), (a, b), head_flops=50, seconds=0.0)


def test_the_frontier_gives_the_cheapest_assignment_for_every_need() -> None:
    m = _measurements()
    options = frontier(m)
    per_block = [[(m.kind_of(i).cost("none").kept_bytes - c.kept_bytes, c.recompute_flops)
                  for c in m.kind_of(i).costs] for i in range(m.num_blocks)]
    every = [tuple(map(sum, zip(*combo))) for combo in itertools.product(*per_block)]  # (saved, flops)
    for needed in range(0, 481, 7):
        brute = min((flops for saved, flops in every if saved >= needed), default=None)
        choice = cheapest_saving(options, needed)
        assert (choice.cost if choice else None) == brute, needed
    assert cheapest_saving(options, 481) is None  # more than keeping nothing saves


def test_modes_that_keep_least_go_to_the_earliest_blocks_of_a_kind() -> None:
    m = _measurements()
    # kind A: one block each of mlp, selective and full; kind B: one none, one attention
    modes = assign(Assignment(((0, 1, 1, 1), (1, 1, 0)), saved_bytes=0, cost=0), m)
    assert modes == ("full", "attention", "selective", "none", "mlp")


def test_a_per_layer_assignment_is_spelled_as_the_shortest_policy() -> None:
    assert policy_of(("full",) * 4) == CheckpointPolicy(mode="full")
    policy = policy_of(("full", "full", "selective", "none", "none", "none"))
    assert policy.to_dict() == {"mode": "none", "layers": {"0-1": "full", "2": "selective"}}
    assert parse_policy(policy.to_dict()) == policy


# --- entry points --------------------------------------------------------------------------------------------


def _tiny_model() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{k: v for k, v in SMALL["config"].items()},
                                  max_position_embeddings=256)
    return AutoModelForCausalLM.from_config(config)


def test_a_plan_for_a_model_is_applied_by_apply_activation_checkpointing() -> None:
    model = _tiny_model()
    ids = torch.randint(0, 512, (2, 128))
    roomy = plan_activation_checkpointing(model, memory_budget="1GiB", example_batch=ids, target="cpu",
                                          all_candidates=True)
    assert roomy.policy == CheckpointPolicy(mode="none") and roomy.recompute_flops == 0
    none, full = (next(c.peak_bytes for c in roomy.candidates if c.label == label) for label in ("none", "full"))
    tight = plan_activation_checkpointing(model, memory_budget=(none + full) // 2, example_batch={"input_ids": ids},
                                          target="cpu")
    assert isinstance(tight, ActivationPlan) and tight.peak_bytes <= tight.budget_bytes < none
    assert 0 < tight.recompute_flops and [b.mode for b in tight.blocks] != ["none"] * 4
    applied = apply_activation_checkpointing(model, tight)
    assert applied.policy == tight.policy
    assert [layer.mode for layer in applied.layers] == [b.mode for b in tight.blocks]
    assert json.loads(tight.to_json())["predicted_peak_bytes"] == tight.peak_bytes


def test_nothing_fits_names_the_smallest_plan_and_what_would_help() -> None:
    # Sizes people can read: the 1 MiB budget and the need in MiB, the policy named once; and the words of the caller:
    # the Python arguments it passed (a recipe's user reads recipe keys: test_profile.py, test_replan.py).
    with pytest.raises(ConfigError, match=r"^memory_budget: nothing fits 1.00 MiB; the smallest plan \(full\) needs "
                                          r"\d\d\d MiB predicted\. What would help: a smaller micro-batch \(batch_size=, "
                                          r"now 4\); FSDP \(strategy='fsdp2' with world_size= ranks .*; the fused loss "
                                          r"\(loss='fused' never holds the logits\); shorter sequences \(seq_length=, "
                                          r"now 512\)$"):
        plan_activation_checkpointing("tiny-llama", memory_budget=2**20, batch_size=4, seq_length=512, target="cpu")


def test_a_budget_below_every_plan_is_refused_after_pricing_full_alone() -> None:
    """Below the floor (full's peak less one block's activations) the planner prices full only, not every
    candidate, before saying nothing fits (full's step is composed from the whole step without checkpointing, the
    one simulated first: NOTE [ The whole step composed from is the one that checkpoints nothing ])."""
    planner = Planner.from_settings(ModelConfig(preset="tiny-llama"), StepSettings(batch_size=4, seq_length=512, target="cpu"))
    with pytest.raises(ConfigError, match="nothing fits 1.00 MiB; the smallest plan \\(full\\)"):
        planner.plan(2**20)
    priced = list(planner._estimates)  # keys: each priced policy's settings, in order
    assert len(priced) == 2 and "'none'" in priced[0] and "'full'" in priced[1], priced


def _recipe_file(tmp_path: Path, **distributed: Any) -> Path:
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "run"), "model": SMALL, "tokenizer": {"vocab_size": 512},
        "dataset": {"seq_length": 128}, "step_scheduler": {"global_batch_size": 2, "local_batch_size": 2,
                                                           "max_steps": 2},
        "checkpoint": {"enabled": False}, "logging": {"progress": "plain", "metrics_file": None},
        "distributed": {"device": "cpu", **distributed},
    }))
    return path


def test_auto_in_a_recipe_is_planned_after_validation_as_data(tmp_path: Path) -> None:

    unplanned = validate_recipe({"model": SMALL, "distributed": {"activation_checkpointing": "auto"}})
    with pytest.raises(ConfigError, match=r"distributed.activation_checkpointing: 'auto' is not planned yet"):
        unplanned.distributed.policy
    with pytest.raises(ConfigError, match=r"distributed.activation_checkpointing.memory_budget: required here: "
                                          r"planning for the CPU"):
        plan_recipe_auto(load_recipe(_recipe_file(tmp_path, activation_checkpointing="auto")))
    auto = {"mode": "auto", "memory_budget": "2GiB"}
    cfg, plan = plan_recipe_auto(load_recipe(_recipe_file(tmp_path, activation_checkpointing=auto)))
    assert plan.budget_bytes == 2 * GIB
    assert cfg.distributed.policy == plan.policy == CheckpointPolicy(mode="none")
    assert cfg.distributed.auto is not None and cfg.distributed.auto.plan == plan.policy  # planned by auto: data
    assert validate_recipe(cfg.model_dump(mode="json", by_alias=True)).distributed == cfg.distributed
    with pytest.raises(ConfigError, match=r"plan_recipe_auto plans a recipe with activation_checkpointing: auto"):
        plan_recipe_auto(load_recipe(_recipe_file(tmp_path, activation_checkpointing="full")))


def test_remat_finetune_trains_an_auto_recipe_within_its_budget(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from remat.cli import main
    from remat.planner.api import planner_for_recipe

    path = _recipe_file(tmp_path, activation_checkpointing="auto")
    planner = planner_for_recipe(load_recipe(path))
    none, full = (planner.estimate(CheckpointPolicy(mode=mode)).peak_bytes for mode in ("none", "full"))
    budget = full + (none - full) // 3
    with caplog.at_level("INFO", logger="remat.planner.handoff"):
        assert main(["finetune", str(path), "--distributed.memory_budget", str(budget), "--logging.memory", "tracked",
                     "--logging.metrics_file", "m.jsonl"]) == 0
    assert any("activation checkpointing 'auto' planned" in r.getMessage() for r in caplog.records)
    records = [json.loads(line) for line in (tmp_path / "run" / "m.jsonl").read_text().splitlines()]
    steps = [r for r in records if "mem_bytes" in r]
    assert len(steps) == 2 and all(r["mem_bytes"] <= budget for r in steps), (steps, budget)
    assert max(r["mem_bytes"] for r in steps) > full  # the plan used the room it had: not full checkpointing


def test_remat_plan_answers_several_budgets_as_json_and_png(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main

    path = _recipe_file(tmp_path, activation_checkpointing="auto")
    out = tmp_path / "plan.json"
    png = tmp_path / "plan.png"
    code = main(["plan", str(path), "--budget", "1GiB", "--budget", "0.1GiB", "--budget", "1MiB", "--json",
                 str(out), "--png", str(png)])
    assert code == 1  # the 1 MiB budget: nothing fits
    printed = capsys.readouterr().out
    assert "frontier: uniform policies" in printed and "budget 1.00 GiB:" in printed and "nothing fits" in printed
    report = json.loads(out.read_text())
    assert report["target"] == "cpu"
    assert [row["label"] for row in report["frontier"]] == ["none", "attention", "mlp", "selective", "full",
                                                            "full every 2nd"]
    roomy, tight, impossible = report["budgets"]
    assert roomy["policy"] == {"mode": "none"} and roomy["recompute_flops"] == 0
    assert tight["predicted_peak_bytes"] <= tight["budget_bytes"] == int(0.1 * GIB)
    assert len(tight["blocks"]) == 4 and {"mode", "offload", "saved_bytes", "recompute_flops"} <= set(
        tight["blocks"][0])
    assert "nothing fits" in impossible["error"] and impossible["budget_bytes"] == 2**20
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kv_sharing_blocks_are_measured_as_their_own_kinds_with_their_fallbacks() -> None:
    """Gemma 3n: the layers that store keys/values for later layers cannot recompute their attention (they would
    write the shared keys/values twice), so only none and mlp are theirs; the layers that reuse them take every mode.
    The shared key/value dict is copied for each measurement (each block writes into it)."""
    from remat.estimate import StepSettings
    from remat.models import ModelConfig
    from remat.planner.measure import measure_blocks

    settings = StepSettings(batch_size=1, seq_length=64, target="cpu")
    m = measure_blocks(settings.to_recipe(ModelConfig(preset="tiny-gemma3n")), settings.run())
    store, reuse = m.kinds
    assert (store.indices, reuse.indices) == ((0, 1), (2, 3))
    assert [c.mode for c in store.costs] == ["none", "mlp"]
    assert [c.mode for c in reuse.costs] == ["none", "attention", "mlp", "selective", "full"]
    assert reuse.cost("full").kept_bytes == 0 < reuse.cost("selective").kept_bytes < reuse.cost("none").kept_bytes
    assert 0 < reuse.cost("attention").recompute_flops < reuse.cost("full").recompute_flops


def test_plans_for_kv_sharing_models_respect_the_producers_fallback() -> None:
    """Gemma 3n end to end: at a tight and a middling budget the plan gives the key/value-storing layers only none or
    mlp, so applying it takes no fallback (no warning) and every block gets exactly the planned mode."""
    import warnings

    from remat.checkpointing import CheckpointingWarning
    from remat.estimate import StepSettings
    from remat.models import ModelConfig, build_model
    from remat.planner import Planner

    model = ModelConfig(preset="tiny-gemma3n")
    planner = Planner.from_settings(model, StepSettings(batch_size=2, seq_length=256, target="cpu"))  # activations matter
    peaks = {c.label: c.peak_bytes for c in planner.uniform_candidates(2**40)}
    assert peaks["full"] < peaks["none"]
    modes = []
    for share in (0.0, 0.5):
        plan = planner.plan(int(peaks["full"] + share * (peaks["none"] - peaks["full"])))
        assert {block.mode for block in plan.blocks[:2]} <= {"none", "mlp"}, plan.policy.describe()
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointingWarning)
            applied = apply_activation_checkpointing(build_model(model), plan.policy)
        assert [layer.mode for layer in applied.layers] == [block.mode for block in plan.blocks]
        modes.append(tuple(block.mode for block in plan.blocks))
    assert any(mode in ("attention", "selective", "full") for mode in modes[0][2:]), modes  # the reusers recompute


def test_auto_plans_a_lora_recipe_with_its_adapters(tmp_path: Path) -> None:
    """A recipe with a ``peft`` section and ``auto``: planned with its adapters (only they have gradients and
    optimizer state), within the budget, and the recipe comes back with its peft section and the chosen policy."""
    from remat.planner.api import planner_for_recipe

    path = _recipe_file(tmp_path, activation_checkpointing="auto")
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "peft": {"r": 4}}))
    planner = planner_for_recipe(load_recipe(path))
    none, full = (planner.estimate(CheckpointPolicy(mode=mode)) for mode in ("none", "full"))
    assert 0 < none.trainable_parameters < none.parameters // 10  # the adapters only
    # AdamW: exp_avg and exp_avg_sq in float32, and a float32 step per adapter tensor (4 blocks x 7 linears x A, B)
    assert none.breakdown["optimizer_state"] == 2 * 4 * none.trainable_parameters + 4 * (4 * 7 * 2)
    budget = full.peak_bytes + (none.peak_bytes - full.peak_bytes) // 2
    cfg, plan = plan_recipe_auto(load_recipe(path, [("distributed.memory_budget", budget)]))
    assert plan is not None and full.peak_bytes <= plan.peak_bytes <= budget
    assert cfg.peft is not None and cfg.peft.r == 4 and cfg.distributed.policy == plan.policy


def test_remat_plan_plans_for_what_the_recipe_would_train_on_here(tmp_path: Path) -> None:
    """``device: auto`` on a machine without a GPU trains on the CPU, so remat plan plans for it (as remat finetune
    and the Python API do); ``--target cuda`` plans for a GPU this machine does not have."""
    import torch

    from remat.cli import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: device auto trains on it here")
    path = _recipe_file(tmp_path, device="auto")
    for flags, expected in (([], "cpu"), (["--target", "cuda"], "cuda")):
        out = tmp_path / f"plan-{expected}.json"
        assert main(["plan", str(path), "--budget", "1GiB", "--json", str(out), *flags]) == 0
        assert json.loads(out.read_text())["target"] == expected


def test_remat_plan_below_every_plan_answers_after_the_floor_without_the_frontier(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`remat plan --budget 1MiB`: the floor's one estimate (full, on the CPU) says nothing fits; the frontier of
    every uniform policy is not priced for a report that could show no plan."""
    from remat.cli import main

    priced: list[str] = []
    candidate = Planner._candidate

    def counted(self: Planner, label: str, *args: Any, **kwargs: Any) -> Any:
        priced.append(label)
        return candidate(self, label, *args, **kwargs)

    monkeypatch.setattr(Planner, "_candidate", counted)
    path = _recipe_file(tmp_path, activation_checkpointing="auto")
    assert main(["plan", str(path), "--budget", "1MiB"]) == 1
    printed = capsys.readouterr().out
    assert "frontier: not priced" in printed and "nothing fits 1.00 MiB" in printed
    assert priced == ["full"]


def test_a_peft_lora_model_is_planned_with_its_adapters_not_as_a_full_fine_tune() -> None:
    """plan_activation_checkpointing(model) of a PEFT LoRA model plans LoRA's step (frozen base, AdamW over the
    adapters): the same prediction as the recipe's peft section, far below the full fine-tune's."""
    from peft import LoraConfig, get_peft_model
    from tiny import tiny_causal_lm

    def model() -> torch.nn.Module:
        return tiny_causal_lm("llama", vocab_size=256, max_position_embeddings=32)

    step = {"memory_budget": "1GiB", "batch_size": 2, "seq_length": 32, "target": "cpu"}
    full = plan_activation_checkpointing(model(), **step)
    lora = plan_activation_checkpointing(
        get_peft_model(model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])), **step)
    section = {"method": "lora", "r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    assert lora.peak_bytes == plan_activation_checkpointing(model(), peft=section, **step).peak_bytes
    assert lora.peak_bytes < 0.6 * full.peak_bytes


def test_a_plan_of_a_recipe_that_compiles_its_blocks_says_it_simulated_them_compiled() -> None:
    from tiny import tiny_recipe

    from remat.planner.api import plan_recipe

    unpacked = {"preset": "tiny-llama", "document_attention": False}  # tests/estimate/test_compiled_blocks.py
    eager = validate_recipe(tiny_recipe(model=unpacked))
    compiled = validate_recipe(tiny_recipe(model=unpacked, compile={"enabled": True}))
    assert not any(note.startswith("compile:") for note in plan_recipe(eager, budget="1GiB", target="cpu").notes)
    plan = plan_recipe(compiled, budget="1GiB", target="cpu")
    note = next(note for note in plan.notes if note.startswith("compile:"))
    assert "simulated compiled (inductor's partition" in note and note in plan.summary() + str(plan)