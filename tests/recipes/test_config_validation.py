"""Malformed recipes are rejected before anything is built, with a message naming the key, the value and what is
allowed."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from remat.errors import ConfigError
from remat.recipes.loader import load_recipe, validate_recipe

BASE: dict[str, Any] = {
    "model": {"preset": "tiny-llama"},
    "dataset": {"seq_length": 64},
    "step_scheduler": {"global_batch_size": 4, "local_batch_size": 2, "max_steps": 3},
}


def with_(path: str, value: Any) -> dict[str, Any]:
    """BASE with one dotted key set (or deleted when value is DELETE)."""
    import copy

    data = copy.deepcopy(BASE)
    node = data
    parts = path.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    if value is DELETE:
        node.pop(parts[-1])
    else:
        node[parts[-1]] = value
    return data


DELETE = object()

CASES = [
    # (id, recipe, fragments the message must contain)
    ("typo-top-level", with_("stepscheduler", {"max_steps": 3}),
     ["stepscheduler: unknown key", "did you mean 'step_scheduler'"]),
    ("typo-nested", with_("step_scheduler.max_step", 3),
     ["step_scheduler.max_step: unknown key", "did you mean 'step_scheduler.max_steps'"]),
    ("wrong-type", with_("step_scheduler.max_steps", "ten"), ["step_scheduler.max_steps", "'ten'", "integer"]),
    ("non-positive", with_("step_scheduler.max_steps", 0), ["step_scheduler.max_steps", "greater than 0"]),
    ("batch-not-multiple", with_("step_scheduler.global_batch_size", 5),
     ["step_scheduler", "global_batch_size (5) must be a multiple of local_batch_size (2)"]),
    ("bad-decay", with_("lr_scheduler.decay", "exp"), ["lr_scheduler.decay", "'exp'", "'cosine', 'linear' or 'constant'"]),
    ("min-lr-ratio", with_("lr_scheduler.min_lr_ratio", 2), ["lr_scheduler.min_lr_ratio", "less than or equal to 1"]),
    ("bad-strategy", with_("distributed.strategy", "zero3"), ["distributed.strategy", "'zero3'", "'single', 'ddp' or 'fsdp2'"]),
    ("bad-policy", with_("distributed.activation_checkpointing", "sometimes"),
     ["distributed.activation_checkpointing", "sometimes", "selective"]),
    ("bad-policy-key", with_("distributed.activation_checkpointing", {"mode": "full", "every_n": 2}),
     ["distributed.activation_checkpointing", "every_n", "every_n_layers"]),
    ("target-not-allowed", with_("optimizer._target_", "os.system"),
     ["optimizer._target_", "'os.system' is outside the allowed packages", "--custom_target_packages"]),
    ("target-typo", with_("optimizer._target_", "torch.optim.AdamWW"),
     ["optimizer._target_", "has no attribute 'AdamWW'", "torch.optim.AdamW"]),
    ("optimizer-kwarg-typo", with_("optimizer.learning_rate", 1e-3),
     ["optimizer.learning_rate: unknown argument", "did you mean 'lr'"]),
    ("optimizer-params", with_("optimizer.params", [1]), ["optimizer.params: set by remat itself"]),
    ("loss-kwarg-typo", with_("loss_fn.ignore_idx", -1), ["loss_fn.ignore_idx: unknown argument", "ignore_index"]),
    ("hidden-states-contradict-the-loss", with_("model.output_hidden_states", True),
     ["model.output_hidden_states: true contradicts loss_fn._target_ 'remat.loss.MaskedCrossEntropy'",
      "consumes logits", "allowed: false, or leave the key out"]),
    ("model-missing", with_("model", DELETE), ["model: required key is missing"]),
    ("model-no-source", with_("model", {"dtype": "float32"}), ["model"]),
    ("model-dtype", with_("model.dtype", "float8"), ["model.dtype", "'float8'", "'float32', 'bfloat16', 'float16' or 'auto'"]),
    ("model-unknown-key", with_("model.presets", "tiny-llama"), ["model.presets: unknown key", "did you mean 'model.preset'"]),
    ("seq-length", with_("dataset.seq_length", 1), ["dataset.seq_length", "greater than or equal to 2"]),
    ("dataset-format", with_("dataset.format", "csv"), ["dataset.format", "'csv'", "'prompt_completion'"]),
    ("val-dataset-typo", with_("validation_dataset", {"splt": "validation"}),
     ["validation_dataset.splt: unknown key", "did you mean 'validation_dataset.split'"]),
    ("peft-rank", with_("peft", {"r": 0}), ["peft.r", "greater than 0"]),
    ("peft-method", with_("peft", {"method": "qlora"}), ["peft.method", "'qlora'", "'lora'"]),
    ("keep-last", with_("checkpoint.keep_last", -1), ["checkpoint.keep_last", "greater than 0"]),
    ("logging-memory", with_("logging.memory", "gpu"), ["logging.memory", "'gpu'", "'tracked'"]),
    ("distributed-device", with_("distributed.device", "gpu"), ["distributed.device", "'gpu'", "'auto', 'cpu' or 'cuda'"]),
    ("tokenizer-vocab", with_("tokenizer.vocab_size", 10), ["tokenizer.vocab_size", "between 512 and 65536"]),
    ("seed-type", with_("seed", "abc"), ["seed", "'abc'"]),
    ("dp-size-single", with_("distributed.dp_size", 2), ["distributed.dp_size: 2 needs strategy 'ddp' or 'fsdp2'"]),
    ("section-not-mapping", with_("step_scheduler", 5), ["step_scheduler", "5"]),
    ("mixed-precision", with_("distributed.mixed_precision", "fp8"),
     ["distributed.mixed_precision", "'fp8'", "'bfloat16', 'float16' or 'float32'"]),
    # below a second no process group forms: refused here instead of torchrun's stack trace
    ("collective-timeout", with_("distributed.timeout_s", 1e-9), ["distributed.timeout_s", "greater than or equal to 1",
                                                                  "1e-09"]),
    ("init-timeout", with_("distributed.init_timeout_s", 0.001), ["distributed.init_timeout_s", "0.001"]),
]


@pytest.mark.parametrize(("recipe", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_recipe_is_explained(recipe: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


def test_base_recipe_is_valid() -> None:
    cfg = validate_recipe(BASE)
    assert cfg.step_scheduler.max_steps == 3
    assert cfg.optimizer.target == "torch.optim.AdamW"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="recipe .*nope.yaml' not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  preset: tiny-llama\n step_scheduler: [\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line 3, column 2: expected <block end>"):
        load_recipe(path)


def test_exponent_floats_are_numbers(tmp_path: Path) -> None:
    path = tmp_path / "lr.yaml"
    path.write_text("model:\n  preset: tiny-llama\noptimizer:\n  lr: 3e-4\n  eps: 1E-8\n")
    cfg = load_recipe(path)
    assert cfg.optimizer.kwargs == {"lr": 3e-4, "eps": 1e-8}


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- dataset\n")
    with pytest.raises(ConfigError, match="top level must be a mapping of sections, got list"):
        load_recipe(path)


def test_every_error_is_reported_at_once() -> None:
    recipe = with_("step_scheduler.max_steps", 0)
    recipe["lr_scheduler"] = {"decay": "exp"}
    with pytest.raises(ConfigError) as info:
        validate_recipe(recipe)
    assert "step_scheduler.max_steps" in str(info.value) and "lr_scheduler.decay" in str(info.value)


def test_custom_target_needs_the_runner_to_trust_its_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "my_training_bits"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import torch\n"
        "class Sgd2(torch.optim.SGD):\n    pass\n"
        "class LogitLoss:\n    consumes = 'logits'\n    def __call__(self, logits, labels, num_label_tokens=None):\n"
        "        return logits.sum()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = with_("optimizer._target_", "my_training_bits.Sgd2")
    recipe["optimizer"]["lr"] = 0.1
    recipe["loss_fn"] = {"_target_": "my_training_bits.LogitLoss"}
    with pytest.raises(ConfigError, match="'my_training_bits.Sgd2' is outside the allowed packages"):
        validate_recipe(recipe)
    recipe["custom_target_packages"] = ["my_training_bits"]
    cfg = validate_recipe(recipe)
    assert (cfg.optimizer.target, cfg.loss_fn.target) == ("my_training_bits.Sgd2", "my_training_bits.LogitLoss")
    # From the command line it works the same; in the recipe file it is refused.
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in recipe.items() if k != "custom_target_packages"}))
    assert load_recipe(path, ["--custom_target_packages", "[my_training_bits]"]).custom_target_packages == [
        "my_training_bits"]
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ConfigError, match="custom_target_packages: set in the recipe file .* cannot widen"):
        load_recipe(path)


def test_every_distributed_key_is_an_argument_of_the_setup() -> None:
    import inspect

    from remat.distributed import DistributedSetup
    from remat.distributed.config import AUTO_KEYS, AutoCheckpointing, DistributedConfig

    assert set(DistributedConfig.model_fields) <= set(inspect.signature(DistributedSetup.build).parameters)
    assert set(AUTO_KEYS) == set(AutoCheckpointing.model_fields) - {"mode", "plan"}


@pytest.mark.parametrize(("distributed", "message"), [
    ({"activation_checkpointing": "full", "memory_budget": "forty gigs", "max_replans": 7},
     r"^invalid recipe:\n  distributed.memory_budget: a key of the planner, read only with "
     r"distributed.activation_checkpointing: auto \(got 'full'\)"),
    ({"activation_checkpointing": {"mode": "selective", "max_replans": 2}},
     r"distributed.activation_checkpointing.max_replans: a key of the planner, read only with mode auto \(got mode "
     r"'selective'\)"),
    ({"activation_checkpointing": {"mode": "auto", "memory_budget": "forty gigs"}},
     r"distributed.activation_checkpointing.memory_budget: got 'forty gigs'; allowed: a number with a unit"),
    ({"activation_checkpointing": {"mode": "auto", "memory_budget": "-1GiB"}},
     r"distributed.activation_checkpointing.memory_budget: got '-1GiB'; a budget is more than nothing"),
    ({"activation_checkpointing": "auto", "memory_budget": -3},
     r"distributed.activation_checkpointing.memory_budget: got -3; a budget is more than nothing"),
    ({"activation_checkpointing": {"mode": "auto", "memory_budget": 1.5}},
     r"memory_budget: got 1.5; a fraction of the device's memory must be in \(0, 1\]"),
    ({"activation_checkpointing": {"mode": "auto", "memory_budget": "1GiB"}, "memory_budget": "2GiB"},
     r"distributed.activation_checkpointing.memory_budget: given twice"),
    ({"activation_checkpointing": {"mode": "auto", "max_replan": 2}},
     r"distributed.activation_checkpointing.max_replan: unknown key \(did you mean "
     r"'distributed.activation_checkpointing.max_replans'\?\)"),
])
def test_the_planner_section_is_checked_when_the_recipe_is_read(distributed: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_recipe({"model": {"preset": "tiny-llama"}, "distributed": distributed})


def test_auto_with_its_keys_nested_or_in_the_older_loose_spelling(caplog: pytest.LogCaptureFixture) -> None:
    from remat.checkpointing.budget import MemoryBudget

    nested = validate_recipe({"model": {"preset": "tiny-llama"}, "distributed": {"activation_checkpointing": {
        "mode": "auto", "memory_budget": "40GiB", "max_replans": 1, "loss": "choose"}}})
    with caplog.at_level("WARNING"):
        loose = validate_recipe({"model": {"preset": "tiny-llama"}, "distributed": {
            "activation_checkpointing": "auto", "memory_budget": "40GiB", "max_replans": 1, "planner_loss": "choose"}})
    assert nested.distributed == loose.distributed
    auto = nested.distributed.auto
    assert auto is not None and auto.memory_budget == MemoryBudget(size_bytes=40 * 2**30) and auto.plan is None
    assert [r.getMessage() for r in caplog.records] == [
        "distributed.memory_budget: deprecated spelling; write the planner's keys under the policy: "
        "distributed.activation_checkpointing: {mode: auto, memory_budget: 40GiB, max_replans: 1, loss: choose}"]
    with pytest.raises(ConfigError, match="'auto' is not planned yet"):
        nested.distributed.policy
    again = validate_recipe(nested.model_dump(mode="json", by_alias=True))  # a saved config reads back the same
    assert again.distributed == nested.distributed
    assert validate_recipe({"model": {"preset": "tiny-llama"}}).distributed.auto is None


def test_a_key_given_twice_is_refused_with_its_lines(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text("model:\n  preset: tiny-llama\nseed: 1\nseed: 2\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML at line 4, column 1: key 'seed' appears twice \(first "
                                          r"at line 3\)"):
        load_recipe(path)


def test_validation_keys_need_a_validation_dataset() -> None:
    with pytest.raises(ConfigError, match="step_scheduler.val_every_steps: set to 5, but the recipe has no "
                                          "validation_dataset"):
        validate_recipe(with_("step_scheduler.val_every_steps", 5))
    ok = with_("step_scheduler.val_every_steps", 5)
    ok["validation_dataset"] = {"split": "validation"}
    assert validate_recipe(ok).step_scheduler.val_every_steps == 5


def test_warmup_longer_than_the_run_is_said_once(caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from remat import _logs

    monkeypatch.setattr(_logs, "_said", set())
    recipe = with_("lr_scheduler.warmup_steps", 10)
    with caplog.at_level("WARNING", logger="remat.recipes.loader"):
        validate_recipe(recipe)
        validate_recipe(recipe)  # an auto run validates its recipe several times: the advice comes once
    assert caplog.text.count("lr_scheduler.warmup_steps (10) is more than step_scheduler.max_steps (3)") == 1


@pytest.mark.parametrize(("loss", "stated"), [("MaskedCrossEntropy", None), ("MaskedCrossEntropy", False),
                                             ("FusedLinearCrossEntropy", None), ("FusedLinearCrossEntropy", True)])
def test_the_model_outputs_follow_from_what_the_loss_consumes(loss: str, stated: bool | None) -> None:
    data = with_("loss_fn._target_", f"remat.loss.{loss}")
    if stated is not None:  # the old key, when it agrees with the loss, is accepted
        data["model"]["output_hidden_states"] = stated
    cfg = validate_recipe(data)
    assert cfg.model.output_hidden_states is (loss == "FusedLinearCrossEntropy")


def test_the_checkpointing_policy_is_parsed_once_and_carried_typed() -> None:
    from remat.checkpointing import CheckpointPolicy

    cfg = validate_recipe(with_("distributed.activation_checkpointing", {"mode": "full", "every_n_layers": 2}))
    policy = cfg.distributed.activation_checkpointing
    assert isinstance(policy, CheckpointPolicy) and (policy.mode, policy.every_n_layers) == ("full", 2)
    dumped = cfg.model_dump(mode="json", by_alias=True)
    assert dumped["distributed"]["activation_checkpointing"] == {"mode": "full", "every_n_layers": 2}
    assert validate_recipe(dumped).distributed.activation_checkpointing == policy  # a saved config reloads


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("lr", -1e-4, "a positive finite number"),
    ("lr", float("inf"), "a positive finite number"),
    ("lr", "fast", "a positive finite number"),
    ("eps", 0, "a positive finite number"),
    ("weight_decay", -0.1, "a finite number >= 0"),
    ("betas", [0.9], r"two numbers in \[0, 1\)"),
    ("betas", [0.9, 1.5], r"two numbers in \[0, 1\)"),
])
def test_optimizer_hyperparameters_are_checked_when_the_recipe_is_read(key: str, value: Any, allowed: str) -> None:
    with pytest.raises(ConfigError, match=rf"optimizer\.{key}: got .*; allowed: {allowed}"):
        validate_recipe(with_(f"optimizer.{key}", value))


def test_good_optimizer_hyperparameters_pass() -> None:
    cfg = validate_recipe(with_("optimizer", {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}))
    assert cfg.optimizer.kwargs["betas"] == [0.9, 0.95]


@pytest.mark.parametrize("seed", [-1, 2**70])
def test_a_seed_outside_what_the_generators_take_is_one_line(seed: int) -> None:
    with pytest.raises(ConfigError, match=r"seed: Input should be"):
        validate_recipe(with_("seed", seed))


def test_a_tile_as_long_as_the_row_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """The long-context example shortened to 1,024 tokens keeps tile_tokens 2048: one tile, nothing tiled."""
    from remat import _logs
    from remat.recipes.loader import load_recipe

    _logs._said.clear()
    example = Path(__file__).resolve().parents[2] / "examples" / "long_context.yaml"
    with caplog.at_level(logging.WARNING, logger="remat"):
        load_recipe(example, ["--dataset.seq_length", "1024"])
    assert any("tile_tokens: 2048 is not less than dataset.seq_length 1024, so a row is one tile and nothing is "
               "tiled" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remat"):
        load_recipe(example)
    assert not any("tile_tokens" in r.message for r in caplog.records)
