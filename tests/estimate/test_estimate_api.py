"""estimate_memory's inputs, errors and outputs; the report helpers; and `remat estimate` on the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from remat.cli import main
from remat.errors import ConfigError
from remat.estimate.api import MemoryEstimate, estimate_memory, resolve_model, settings_from_recipe
from remat.estimate.report import comparison_table, parse_capacity, plot_breakdowns
from remat.estimate.settings import StepSettings
from remat.models import ModelConfig
from remat.recipes.loader import validate_recipe

TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


@pytest.fixture(scope="module")
def config_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps({**TINY_CONFIG, "transformers_version": "5.23.0", "trust_remote_code": False}))
    return path


@pytest.fixture(scope="module")
def estimate(config_json: Path) -> MemoryEstimate:
    return estimate_memory(config_json, batch_size=2, seq_length=32, policy="full", loss="fused", label="mine")


# ------------------------------------------------------------------------------------------------ model sources

def test_models_resolve_from_presets_files_directories_and_mappings(config_json: Path) -> None:
    assert resolve_model("llama-3.2-1b") == ModelConfig(preset="llama-3.2-1b")
    from_file = resolve_model(config_json)
    assert from_file.config is not None and from_file.config["hidden_size"] == 64
    assert "transformers_version" not in from_file.config and "trust_remote_code" not in from_file.config
    assert resolve_model(config_json.parent) == from_file
    assert resolve_model(TINY_CONFIG).config == TINY_CONFIG


def test_a_pretrained_directory_is_estimated_from_its_config_only(config_json: Path) -> None:
    cfg = resolve_model(ModelConfig(pretrained_model_name_or_path=str(config_json.parent), dtype="bfloat16"))
    assert cfg.source == "config" and cfg.dtype == "bfloat16"  # no weights are read


@pytest.mark.parametrize(("model", "message"), [
    ("llama-3.2-1bb", "llama-3.2-1b"),  # the preset error names the close match
    ({"hidden_size": 8}, "model_type"),
    ({"model_type": "llamma"}, "llama"),
    (42, "preset name"),
])
def test_unknown_models_are_config_errors(model: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_model(model)


# ------------------------------------------------------------------------------------------------ settings errors

@pytest.mark.parametrize(("options", "message"), [
    ({"batch_size": 0}, "batch_size: got 0"),
    ({"seq_length": 1}, "seq_length: got 1"),
    ({"world_size": 2}, "world_size: 2 needs strategy"),
    ({"strategy": "zero3"}, "strategy: got 'zero3'"),
    ({"loss": "focal"}, "loss: got 'focal'"),
    ({"dtype": "int8"}, "dtype: got 'int8'"),
    ({"target": "tpu"}, "target: got 'tpu'"),
    ({"mixed_precision": "bfloat16"}, "mixed_precision: 'bfloat16' is FSDP2's"),
    ({"policy": "fulll"}, "policy"),
    ({"documents_per_row": 40}, "documents_per_row: 40"),
    ({"batchsize": 2}, "batchsize: not a setting"),
    ({"optimizer": "os.system"}, "optimizer._target_"),
])
def test_bad_settings_are_config_errors_naming_the_setting(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        estimate_memory(TINY_CONFIG, **{"seq_length": 64, **options})


# ------------------------------------------------------------------------------------------------ outputs

def test_estimate_reports_consistent_figures(estimate: MemoryEstimate) -> None:
    assert estimate.name == "mine"
    assert sum(estimate.breakdown.values()) == estimate.peak_bytes
    assert estimate.peak_bytes >= estimate.tensor_peak_bytes
    assert estimate.peak_bytes == max(estimate.phase_peaks.values())
    assert estimate.phase in estimate.phase_peaks
    assert estimate.settings.dtype == "float32"  # the model's dtype, made explicit
    assert estimate.fits(estimate.peak_bytes) and not estimate.fits(estimate.peak_bytes - 1)


def test_to_json_round_trips_every_figure(estimate: MemoryEstimate) -> None:
    data = json.loads(estimate.to_json())
    assert data["peak_bytes"] == estimate.peak_bytes
    assert data["breakdown"] == estimate.breakdown
    assert data["settings"]["policy"] == "full" and data["settings"]["loss"] == "fused"
    assert data["peak_gib"] == round(estimate.peak_bytes / 2**30, 4)


def test_table_names_every_category_and_the_phase(estimate: MemoryEstimate) -> None:
    table = estimate.table(capacity_bytes=2**40)
    for word in ("parameters", "optimizer_state", "activations", "peak phase", "fits 1.00 TiB: yes"):
        assert word in table


@pytest.mark.parametrize(("text", "nbytes"), [("80GiB", 80 * 2**30), ("80 GB", 80 * 10**9), ("1.5MiB", 3 * 2**19),
                                              ("512b", 512)])
def test_capacities_parse_with_units(text: str, nbytes: int) -> None:
    assert parse_capacity(text) == nbytes


@pytest.mark.parametrize("text", ["80", "80 parsecs", "GiB", ""])
def test_capacities_without_a_known_unit_are_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="--fits"):
        parse_capacity(text)


def test_comparison_table_and_plot(estimate: MemoryEstimate, tmp_path: Path) -> None:
    table = comparison_table([estimate, estimate], capacity_bytes=1)
    rows = [line for line in table.splitlines() if line.startswith("mine")]
    assert len(rows) == 2 and rows[0].rstrip().endswith("NO")
    png = plot_breakdowns([estimate], tmp_path / "chart.png", capacity_bytes=2**30)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match=".png"):
        plot_breakdowns([estimate], tmp_path / "chart.jpg")


# ------------------------------------------------------------------------------------------------ recipes

def _recipe(**sections: Any) -> Any:
    data: dict[str, Any] = {
        "model": {"config": TINY_CONFIG, "output_hidden_states": True},
        "dataset": {"seq_length": 64},
        "step_scheduler": {"global_batch_size": 8, "local_batch_size": 2},
        "loss_fn": {"_target_": "remat.loss.FusedLinearCrossEntropy", "chunk_size": 64},
        "distributed": {"strategy": "fsdp2", "activation_checkpointing": "selective", "dp_size": 2},
        "clip_grad_norm": {"max_norm": None},
    }
    data.update(sections)
    return validate_recipe(data)


def test_recipe_settings_are_the_recipes_step() -> None:
    model, settings = settings_from_recipe(_recipe())
    assert model.config is not None and model.config["hidden_size"] == 64
    assert (settings.batch_size, settings.seq_length, settings.grad_accumulation) == (2, 64, 2)
    assert (settings.strategy, settings.world_size, settings.policy) == ("fsdp2", 2, "selective")
    assert settings.loss == "fused" and dict(settings.loss_kwargs) == {"chunk_size": 64}
    assert settings.clip_grad_norm is None  # the step measures the norm without clipping, as the recipe does
    assert settings.vocab_size == 4096  # the builtin tokenizer's


def test_recipe_options_override_and_a_new_loss_drops_the_recipes_loss_arguments() -> None:
    _, settings = settings_from_recipe(_recipe(optimizer={"_target_": "torch.optim.AdamW", "lr": 0.01,
                                                          "betas": [0.9, 0.95]}),
                                       batch_size=1, loss="plain", world_size=4, optimizer="torch.optim.SGD")
    assert (settings.batch_size, settings.loss, dict(settings.loss_kwargs)) == (1, "plain", {})
    assert settings.world_size == 4 and settings.grad_accumulation == 1
    assert (settings.optimizer, dict(settings.optimizer_kwargs)) == ("torch.optim.SGD", {"lr": 0.01})


@pytest.mark.parametrize(("sections", "message"), [
    ({"loss_fn": {"_target_": "torch.nn.CrossEntropyLoss"}}, "loss_fn._target_"),
    ({"step_scheduler": {"global_batch_size": 6, "local_batch_size": 2}}, "global_batch_size"),
    ({"distributed": {"strategy": "fsdp2", "cpu_offload": True, "dp_size": 1}}, "distributed.cpu_offload"),
])
def test_recipes_the_estimate_cannot_model_are_config_errors(sections: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        settings_from_recipe(_recipe(**sections))


# ------------------------------------------------------------------------------------------------ command line

def test_cli_compare_prints_one_row_per_setting(config_json: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "e.json", tmp_path / "e.png"
    code = main(["estimate", "--config", str(config_json), "--batch-size", "2", "--seq-length", "32", "--compare",
                 "--setting", "policy={mode: full, every_n_layers: 2},loss=fused", "--fits", "1GiB",
                 "--json", str(out_json), "--plot", str(out_png), "--target", "cpu"])
    assert code == 0
    printed = capsys.readouterr().out
    names = [f"{p} + {loss}" for p in ("none", "selective", "full") for loss in ("plain", "fused")]
    for name in names:
        assert any(line.startswith(name) and line.rstrip().endswith("yes") for line in printed.splitlines())
    assert "policy={mode: full, every_n_layers: 2},loss=fused" in printed
    rows = json.loads(out_json.read_text())
    assert [row["name"] for row in rows] == [*names, "policy={mode: full, every_n_layers: 2},loss=fused"]
    assert rows[-1]["settings"]["policy"] == {"mode": "full", "every_n_layers": 2}
    assert out_png.stat().st_size > 1000


def test_cli_single_estimate_from_a_recipe_with_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "recipe.yaml"
    without_vocab = {k: v for k, v in TINY_CONFIG.items() if k != "vocab_size"}  # the tokenizer's, like a recipe
    recipe.write_text(yaml.safe_dump({
        "model": {"config": without_vocab},
        "dataset": {"seq_length": 64},
        "step_scheduler": {"global_batch_size": 2, "local_batch_size": 2},
    }))
    code = main(["estimate", str(recipe), "--step_scheduler.local_batch_size", "1", "--policy", "full",
                 "--target", "cpu", "--json", str(tmp_path / "one.json")])
    assert code == 0
    assert "peak phase:" in capsys.readouterr().out
    data = json.loads((tmp_path / "one.json").read_text())
    assert (data["settings"]["batch_size"], data["settings"]["grad_accumulation"]) == (1, 2)
    assert data["settings"]["policy"] == "full"


@pytest.mark.parametrize(("argv", "message"), [
    (["estimate"], "give a recipe, --preset NAME or --config PATH"),
    (["estimate", "--preset", "llama-9b"], "llama-9b"),
    (["estimate", "--preset", "tiny-llama", "--fits", "lots"], "--fits"),
    (["estimate", "--preset", "tiny-llama", "--setting", "flavour=mint"], "unknown key 'flavour'"),
    (["estimate", "--preset", "tiny-llama", "--setting", "loss=fused", "--setting", "policy=full"], "--compare"),
    (["estimate", "--preset", "tiny-llama", "--world-size", "4"], "world_size: 4 needs strategy"),
    (["estimate", "--preset", "tiny-llama", "--model.dtype", "bfloat16"], "recipe: got 'bfloat16' as well as"),
    (["estimate", "--preset", "tiny-llama", "--model.dtype=bfloat16"], "unrecognized arguments: --model.dtype"),
])
def test_cli_mistakes_exit_2_with_one_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_settings_defaults_are_documented_values() -> None:
    settings = StepSettings()
    assert (settings.batch_size, settings.seq_length, settings.target, settings.strategy) == (1, 2048, "cuda", "single")


def test_moe_models_estimate_in_every_float_dtype_on_the_cpu() -> None:
    """float32 and float16 MoE experts are simulated with remat's own shape rule where torch's takes bfloat16 only
    (`remat.estimate.simulate._grouped_mm_output`; equal to the real step: tests/estimate/test_estimate_vs_real.py)."""
    estimate = estimate_memory("tiny-moe", batch_size=1, seq_length=64, dtype="bfloat16", target="cpu")
    assert estimate.peak_bytes > estimate.breakdown["parameters"] > 0
    float32 = estimate_memory("tiny-moe", batch_size=1, seq_length=64, target="cpu")
    assert float32.parameters == estimate.parameters
    assert float32.breakdown["parameters"] >= 4 * float32.parameters == 2 * estimate.breakdown["parameters"]


def test_the_cuda_estimate_models_the_fused_losss_compiled_fast_path() -> None:
    from remat.estimate.simulate import with_cuda_loss_defaults

    def loss_phase(**loss_kwargs: Any) -> int:
        settings = StepSettings(batch_size=2, seq_length=256, loss="fused", loss_kwargs=loss_kwargs, target="cuda",
                                dtype="bfloat16", policy="full")
        return estimate_memory("tiny-llama", settings).phase_peaks["loss"]

    default, compiled, eager = loss_phase(), loss_phase(compile=True), loss_phase(compile=False)
    assert default == compiled != eager  # a GPU takes the compiled path unless the recipe says compile: false
    plain = validate_recipe({"model": {"preset": "tiny-llama"}})
    assert with_cuda_loss_defaults(plain) is plain  # the plain loss has no fast path to choose
    fused = validate_recipe({"model": {"preset": "tiny-llama"},
                             "loss_fn": {"_target_": "remat.loss.FusedLinearCrossEntropy", "chunk_size": 64}})
    assert with_cuda_loss_defaults(fused).loss_fn.kwargs == {"chunk_size": 64, "compile": True}


def test_a_lora_estimate_says_how_many_parameters_are_trained() -> None:
    from remat.estimate.report import describe_settings

    lora = estimate_memory("tiny-llama", batch_size=1, seq_length=32, target="cpu",
                           peft={"r": 4, "target_modules": ["q_proj", "v_proj"]})
    whole = estimate_memory("tiny-llama", batch_size=1, seq_length=32, target="cpu")
    assert 0 < lora.trainable_parameters < whole.trainable_parameters == whole.parameters < lora.parameters
    assert f"LoRA ({lora.trainable_parameters:,} of {lora.parameters:,} parameters trained)" in describe_settings(lora)
    assert "LoRA" not in describe_settings(whole)
    assert lora.breakdown["gradients"] < whole.breakdown["gradients"]
    with pytest.raises(ConfigError, match=r"peft\.r"):
        estimate_memory("tiny-llama", batch_size=1, seq_length=32, target="cpu", peft={"r": 0})


def test_a_published_config_with_a_key_transformers_ignores_is_accepted_and_a_written_one_refused(
        tmp_path: Path) -> None:
    """A config.json its authors published (Qwen2.5's carries use_mrope, which Qwen2Config has no field for) loads in
    transformers without a word, so the estimate takes it too; the same key written in a recipe's model.config is
    still a typo that would build the wrong model."""
    published = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "use_mrope": False}
    (tmp_path / "config.json").write_text(json.dumps(published))
    cfg = resolve_model(str(tmp_path))
    assert "use_mrope" not in cfg.config and cfg.config["hidden_size"] == 64
    with pytest.raises(ConfigError, match=r"model.config.use_mrope: Qwen2Config \('qwen2'\) has no such field"):
        resolve_model(published)


def test_a_config_json_nested_too_deep_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ConfigError, match=r"^model: .*config.json nests deeper than Python's JSON reader goes"):
        resolve_model(str(tmp_path))
