"""benchmarks/nemo_recipes.py on a NeMo-shaped checkout of this test's recipes: the sweep counts accepted, refused
and crashed recipes with the keys refused, and the table is written; the published configs it caches are the shapes
remat's presets and estimates know."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import yaml

HERE = Path(__file__).resolve().parent / "nemo"


def test_the_sweep_counts_what_is_accepted_and_what_is_refused_by_key(
        tmp_path: Path, benchmark_script: Callable[[str], ModuleType]) -> None:
    bench = benchmark_script("nemo_recipes")
    examples = tmp_path / "nemo" / "examples" / "llm_finetune" / "llama"
    examples.mkdir(parents=True)
    shutil.copy(HERE / "llama_packed_fused.yaml", examples / "accepted.yaml")
    refused = yaml.safe_load((HERE / "llama_packed_fused.yaml").read_text())
    refused["distributed"]["pp_size"] = 4
    refused["model"]["mtp_loss_scaling_factor"] = 0.1  # multi-token prediction: refused by name
    (examples / "refused.yaml").write_text(yaml.safe_dump(refused))
    results = bench.sweep(tmp_path / "nemo")
    assert results["examples/llm_finetune/llama/accepted.yaml"]["code"] in (0, None)
    said = results["examples/llm_finetune/llama/refused.yaml"]
    assert said["code"] == 2 and [line.split(":", 1)[0] for line in said["refused"]] == [
        "distributed.pp_size", "model.mtp_loss_scaling_factor"], said
    again = bench.second_round(tmp_path / "nemo", results)
    assert list(again) == ["examples/llm_finetune/llama/refused.yaml"]
    assert again["examples/llm_finetune/llama/refused.yaml"]["code"] in (0, None)  # the two keys out: accepted
    bench.write(results, [], tmp_path / "out", tmp_path / "nemo", again)
    table = (tmp_path / "out" / "nemo_recipes.md").read_text()
    assert "2 recipes: **1 accepted as written**, 1 refused in one round, 0 tracebacks" in table
    assert ("read again: 1 of 1 accepted, 0 still refused only for keys the first round named, 0 with a key refused "
            "a round late.") in table
    assert "| `distributed.pp_size` | 1 |" in table and "| `model.mtp_loss_scaling_factor` | 1 |" in table
    written = json.loads((tmp_path / "out" / "nemo_recipes.json").read_text())
    assert written["estimates"] == [] and "rng.seed" in written["accepted_keys"]  # the accepted recipe's keys


def test_the_published_configs_are_those_of_the_models_the_recipes_name(
        benchmark_script: Callable[[str], ModuleType]) -> None:
    from transformers import AutoConfig

    bench = benchmark_script("nemo_recipes")
    configs = bench.published_configs()
    assert {model for _, model, _ in bench.REPRESENTATIVE} == set(configs)
    for hub_id, data in configs.items():  # each loads as transformers reads the file
        config = AutoConfig.for_model(**data)
        assert config.num_hidden_layers == data["num_hidden_layers"] and data["torch_dtype"] == "bfloat16", hub_id
    assert configs["meta-llama/Llama-3.1-70B"]["num_hidden_layers"] == 80
    assert configs["google/gemma-3-270m"]["layer_types"].count("full_attention") == 3
