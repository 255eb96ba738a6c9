"""Recipes in NeMo AutoModel's ``llm_finetune`` schema (tests/recipes/nemo/, written as its published recipes are):
read key by key into remat's spelling with one line each, trained, or refused one line per key with what to write
instead (`remat.recipes.nemo`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from remat.errors import ConfigError
from remat.recipes.finetune import FinetuneRecipe
from remat.recipes.loader import load_recipe
from remat.recipes.nemo import from_nemo, is_nemo_recipe

HERE = Path(__file__).resolve().parent / "nemo"


@pytest.fixture(autouse=True)
def cached_llama_config(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """meta-llama/Llama-3.2-1B's config.json in a Hub cache of its own, read offline: NeMo's default dtype (auto) is
    the one that file names. The processes a test starts get the same cache through its environment."""
    import huggingface_hub.constants
    from hub_datasets import cache_model_config, llama_3_2_1b_config

    hub = tmp_path_factory.getbasetemp() / "nemo-hub"
    if not hub.exists():
        cache_model_config(hub, "meta-llama/Llama-3.2-1B", llama_3_2_1b_config())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_a_nemo_recipe_reads_as_remat_keys(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    caplog.set_level("INFO", logger="remat.recipes.loader")
    cfg = load_recipe(HERE / "llama_packed_fused.yaml", ["--output_dir", str(tmp_path)])
    assert cfg.seed == 1111 and cfg.model.preset == "tiny-llama" and cfg.model.dtype == "float32"
    assert cfg.loss_fn.target == "remat.loss.FusedLinearCrossEntropy" and cfg.model.output_hidden_states is True
    d = cfg.distributed
    assert (d.strategy, d.dp_size, d.timeout_s, d.policy.mode) == ("fsdp2", None, 600.0, "full")
    assert (cfg.dataset.packing, cfg.dataset.seq_length, cfg.dataset.shuffle) == (True, 128, True)
    assert cfg.lr_scheduler.decay == "cosine" and cfg.lr_scheduler.min_lr_ratio == pytest.approx(0.1)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("NeMo AutoModel recipe: ")]
    assert "NeMo AutoModel recipe: packed_sequence.packed_sequence_size 128 -> dataset.packing true, " \
           "dataset.seq_length 128 (packed rows attend per document)" in said
    assert any("loss_fn._target_ nemo_automodel.components.loss.linear_ce.FusedLinearCrossEntropy -> "
               "remat.loss.FusedLinearCrossEntropy" in line for line in said)
    assert len(said) == len(set(said)) >= 15


@pytest.mark.slow
def test_a_nemo_recipe_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_recipe(HERE / "llama_packed_fused.yaml", ["--output_dir", str(tmp_path), "--tokenizer.vocab_size",
                                                         "512", "--step_scheduler.max_steps", "1"])
    job = FinetuneRecipe(cfg)
    try:
        result = job.run()
    finally:
        job.dist.close()  # the recipe's fsdp2 joined a one-process group: leave it for the tests after this one
    assert [r.step for r in result.records] == [1] and result.records[0].loss > 0


def test_the_published_squad_recipe_reads_as_written(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="remat.recipes.loader")
    cfg = load_recipe(HERE / "llama_squad.yaml")
    train, validation = cfg.dataset, cfg.validation_dataset
    assert (train.path, train.template, train.split, train.packing) == ("rajpurkar/squad", "squad", "train", False)
    assert (validation.path, validation.split, validation.max_samples) == ("rajpurkar/squad", "validation", 64)
    assert ("NeMo AutoModel recipe: validation_dataset._target_ make_squad_dataset -> validation_dataset.template squad "
            "(dataset_name -> path; limit_dataset_samples -> max_samples)") in (
        caplog.text)
    # no torch_dtype: NeMo's from_pretrained default (auto) is the checkpoint's dtype, as NeMo would train it
    assert cfg.model.dtype == "auto"
    assert ("NeMo AutoModel recipe: model.torch_dtype auto (NeMo's default) -> model.dtype auto (the dtype the "
            "checkpoint's config.json names)") in caplog.text


def test_nemo_s_default_dtype_is_read_when_the_model_is_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """NeMo's default dtype is remat's ``model.dtype: auto``: the recipe reads without the checkpoint; the dtype is
    the cached config.json's when the model is needed, one line naming what to download or write where it is not
    cached; a model swapped for a preset has float32 (no checkpoint names one), an explicit model.dtype wins; NeMo's
    from_config is bfloat16."""
    import huggingface_hub.constants

    from remat.models.config import with_concrete_dtype

    caplog.set_level("INFO", logger="remat.models.config")
    assert with_concrete_dtype(load_recipe(HERE / "llama_squad.yaml").model).dtype == "bfloat16"
    assert "model.dtype: auto -> bfloat16 (meta-llama/Llama-3.2-1B's config.json)" in caplog.text
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    model = load_recipe(HERE / "llama_squad.yaml").model
    with pytest.raises(ConfigError) as info:
        with_concrete_dtype(model)
    assert str(info.value).startswith("model.dtype: cannot read config.json for the Hub id 'meta-llama/Llama-3.2-1B' "
                                      "(HF_HUB_OFFLINE is set and 'meta-llama/Llama-3.2-1B' is not in the Hugging "
                                      "Face cache") and "\n" not in str(info.value)
    swapped = ["--model.pretrained_model_name_or_path", "null", "--model.preset", "tiny-llama"]
    assert with_concrete_dtype(load_recipe(HERE / "llama_squad.yaml", swapped).model).dtype == "float32"
    assert load_recipe(HERE / "llama_squad.yaml", ["--model.dtype", "float16"]).model.dtype == "float16"
    data = yaml.safe_load((HERE / "llama_squad.yaml").read_text())
    data["model"] = {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
                     "config": {"model_type": "llama", "hidden_size": 64}}
    out, said = from_nemo(data)
    assert out["model"]["dtype"] == "bfloat16" and ("model.torch_dtype auto (NeMo's default) -> model.dtype bfloat16 "
                                                    "(NeMo's from_config builds auto in bfloat16)") in said


def test_the_squad_recipe_trains_three_steps_from_a_datasets_cache(tmp_path: Path) -> None:
    """The user's path: ``remat finetune`` of the NeMo recipe, offline, its rajpurkar/squad read from the datasets
    cache (tiny stand-in rows), its model swapped for the tiny preset on the command line."""
    from hub_datasets import SQUAD_ROWS, cache_hub_dataset
    from processes import run_bounded

    cache_hub_dataset(tmp_path / "hf" / "datasets", "rajpurkar/squad",
                      {"train": SQUAD_ROWS, "validation": SQUAD_ROWS[:6]}, config="plain_text")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "REMAT_CACHE_DIR": str(tmp_path / "remat-cache")}
    env.pop("HF_DATASETS_CACHE", None)
    proc = run_bounded([sys.executable, "-m", "remat.cli", "finetune", str(HERE / "llama_squad.yaml"),
                        "--model.pretrained_model_name_or_path", "null", "--model.preset", "tiny-llama",
                        "--distributed.strategy", "single", "--step_scheduler.max_steps", "3",
                        "--step_scheduler.global_batch_size", "4", "--step_scheduler.local_batch_size", "2",
                        "--step_scheduler.val_every_steps", "3", "--dataset.seq_length", "64",
                        "--output_dir", str(tmp_path / "run")], env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ") and "| loss " in line]
    assert len(steps) == 3, proc.stdout
    assert "dataset.path: the Hub dataset rajpurkar/squad[train], 24 rows (from the HF cache, offline)" in proc.stderr
    assert "validation_dataset: 6 documents (messages)" in proc.stderr  # the tokenizer's chat template, as NeMo


def test_nemo_s_dataset_builders_map_to_templates_and_what_remat_lacks_is_listed_at_once() -> None:
    builder = "nemo_automodel.components.datasets.llm."
    data = yaml.safe_load((HERE / "llama_squad.yaml").read_text())
    data["dataset"] = {"_target_": builder + "hellaswag.HellaSwag", "path_or_dataset": "rowan/hellaswag",
                       "split": "train", "num_samples_limit": 100, "pad_to_max_length": False}
    data["validation_dataset"] = {
        "_target_": builder + "column_mapped_text_instruction_dataset.ColumnMappedTextInstructionDataset",
        "path_or_dataset_id": "./sample-datasets/prompt_completion/validation.jsonl", "split": "train",
        "column_mapping": {"question": "prompt", "answer": "completion"}, "answer_only_loss_mask": True,
        "padding": "do_not_pad", "truncation": "longest_first", "seq_length": 2048}
    out, said = from_nemo(data)
    assert out["dataset"] == {"path": "rowan/hellaswag", "template": "hellaswag", "packing": False, "split": "train",
                              "max_samples": 100, "shuffle": False}
    assert out["validation_dataset"] == {
        "path": "./sample-datasets/prompt_completion/validation.jsonl", "template": "columns", "packing": False,
        "seq_length": 2048, "column_mapping": {"question": "prompt", "answer": "completion"},
        "use_chat_template": False}
    assert any(line.startswith("validation_dataset._target_ ColumnMappedTextInstructionDataset -> validation_dataset."
                               "template columns (path_or_dataset_id -> path; split 'train' dropped") for line in said)
    data["validation_dataset"]["chat_template"] = "templates/chat.jinja"  # the builder's own template: a file
    out, said = from_nemo(data)
    assert out["validation_dataset"]["chat_template"] == "templates/chat.jinja"
    assert any("chat_template kept" in line for line in said if line.startswith("validation_dataset._target_"))
    data["dataset"].update(streaming=True)
    data["validation_dataset"].update(answer_only_loss_mask=False)
    data["packed_sequence"] = {"packed_sequence_size": "1k"}
    with pytest.raises(ConfigError) as info:
        from_nemo(data)
    lines = str(info.value).splitlines()[1:]
    assert [line.split(":")[0] for line in lines] == [
        "dataset.streaming", "validation_dataset.answer_only_loss_mask", "packed_sequence.packed_sequence_size"], lines


def test_nemo_s_agent_and_xlam_builders_are_the_tool_call_templates() -> None:
    builder = "nemo_automodel.components.datasets.llm."
    data = yaml.safe_load((HERE / "llama_squad.yaml").read_text())
    data["dataset"] = {"_target_": builder + "agent_chat.make_agent_chat_dataset",
                       "dataset_name": "llamafactory/glaive_toolcall_en", "split": "train", "seq_length": 4096,
                       "filter_no_assistant": True, "trim_incomplete_last_turn": True,
                       "tokenizer": {"pretrained_model_name_or_path": "meta-llama/Llama-3.2-1B"}}
    data["validation_dataset"] = {"_target_": builder + "xlam.make_xlam_dataset", "split": "train[:256]",
                                  "limit_dataset_samples": 256}
    evaluator = "nemo_automodel.components.eval.tool_call_evaluator.ToolCallAccuracyEvaluator"
    data["tool_call_eval"] = {"_target_": evaluator, "max_new_tokens": 256}
    out, said = from_nemo(data)
    assert out["dataset"] == {"path": "llamafactory/glaive_toolcall_en", "template": "agent_chat", "packing": False,
                              "split": "train", "seq_length": 4096, "shuffle": False,
                              "agent_chat": {"trim_incomplete_last_turn": True}}
    assert out["validation_dataset"] == {"path": "Salesforce/xlam-function-calling-60k", "template": "xlam",
                                         "packing": False, "split": "train[:256]", "max_samples": 256}
    assert "tool_call_eval" not in out
    line = next(line for line in said if line.startswith("dataset._target_ make_agent_chat_dataset"))
    for part in ("seq_length 4096: remat cuts every row at it", "trim_incomplete_last_turn -> dataset.agent_chat",
                 "filter_no_assistant dropped (a row without an assistant turn has no loss target"):
        assert part in line, line
    assert any(line.startswith("tool_call_eval: dropped (NeMo's tool-call accuracy evaluator") for line in said)
    data["dataset"].update(filter_overlong=True, truncate_history=True, revision="refs/convert/parquet")
    out, _ = from_nemo(data)
    assert out["dataset"]["revision"] == "refs/convert/parquet"
    assert out["dataset"]["agent_chat"] == {"trim_incomplete_last_turn": True, "truncate_history": True,
                                            "filter_overlong": True}
    data["dataset"].update(train_on_last_turn_only=True, streaming=True)
    with pytest.raises(ConfigError) as info:
        from_nemo(data)
    assert [line.split(":")[0] for line in str(info.value).splitlines()[1:]] == [
        "dataset.train_on_last_turn_only", "dataset.streaming"]


def test_every_problem_of_a_nemo_recipe_is_said_in_one_round(tmp_path: Path) -> None:
    """What NeMo's translation refuses and what the recipe's own validation would refuse next come in one error, each
    key once, and the keys NeMo writes out of habit (a remote-code flag, NeMo's own switches) are not among them."""
    data = yaml.safe_load((HERE / "llama_squad.yaml").read_text())
    data["model"].update(trust_remote_code=True, force_hf=True, attn_implementation="flash_attention_2")
    data["distributed"].update(defer_fsdp_grad_sync=True, ep_size=8)
    data.update(skypilot={"cloud": "x"}, nvtx={"enabled": False}, quantization={"enabled": True})  # not bnb's key
    data["step_scheduler"]["warmup_ratio"] = 0.1  # not a NeMo key remat maps: the recipe's validation says it
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_recipe(path)
    first, *lines = str(info.value).splitlines()
    keys = [line.split(":")[0] for line in lines]
    assert first == "a NeMo AutoModel recipe with keys remat cannot read as written:"
    assert keys == ["distributed.ep_size", "model.quantization.enabled", "step_scheduler.warmup_ratio"], lines
    del data["distributed"]["ep_size"], data["quantization"], data["step_scheduler"]["warmup_ratio"]
    path.write_text(yaml.safe_dump(data))
    cfg = load_recipe(path)  # the changes asked for, and nothing more: accepted
    assert cfg.model.trust_remote_code is False and cfg.model.attn_implementation == "sdpa"
    assert cfg.distributed.fsdp_reduce_every_micro_batch is False


def test_nemo_s_compile_section_is_remat_s_per_block_compile() -> None:
    data = yaml.safe_load((HERE / "llama_squad.yaml").read_text())
    data["compile"] = {"enabled": True, "mode": "default", "fullgraph": False, "dynamic": True, "backend": None}
    out, said = from_nemo(data)
    assert out["compile"] == {"enabled": True, "backend": "inductor", "mode": "default", "fullgraph": False,
                              "dynamic": True}
    assert any(line.startswith("compile (enabled) -> compile: torch.compile of each decoder block") for line in said)


def test_nemo_s_packing_options_are_said_with_what_remat_does() -> None:
    data = yaml.safe_load((HERE / "llama_squad.yaml").read_text())
    data["packed_sequence"] = {"packed_sequence_size": 1024, "packing_strategy": "thd", "split_across_pack": False,
                               "num_proc": 1, "max_packs": 104}
    out, said = from_nemo(data)
    assert out["dataset"]["packing"] is True and out["dataset"]["seq_length"] == 1024
    assert [line.split(" ")[0] for line in said if line.startswith("packed_sequence.")] == [
        "packed_sequence.packed_sequence_size", "packed_sequence.packing_strategy", "packed_sequence.split_across_pack",
        "packed_sequence.num_proc", "packed_sequence.max_packs"]
    data["packed_sequence"] = {"packed_sequence_size": 1024, "packing_strategy": "bshd", "pack_fn": "x"}
    with pytest.raises(ConfigError) as info:
        from_nemo(data)
    assert [line.split(":")[0] for line in str(info.value).splitlines()[1:]] == [
        "packed_sequence.packing_strategy", "packed_sequence.pack_fn"]


def test_torch_dtype_auto_is_the_checkpoint_s_dtype(tmp_path: Path) -> None:
    from remat.models.config import ModelConfig, with_concrete_dtype

    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"model_type": "llama", "torch_dtype": "bfloat16"}')
    data = yaml.safe_load((HERE / "llama_squad.yaml").read_text())
    data["model"].update(pretrained_model_name_or_path=str(checkpoint), torch_dtype="auto")
    out, said = from_nemo(data)
    assert out["model"]["dtype"] == "auto"
    assert "model.torch_dtype auto -> model.dtype auto (the dtype the checkpoint's config.json names)" in said
    model = ModelConfig.model_validate(out["model"])
    assert with_concrete_dtype(model).dtype == "bfloat16"
    (checkpoint / "config.json").write_text('{"model_type": "llama", "torch_dtype": "float8_e4m3fn"}')
    with pytest.raises(ConfigError, match=r"^model.dtype: auto is 'float8_e4m3fn' in .*model's config.json, which "
                                          r"remat does not train in; allowed: model.dtype: float32, bfloat16, float16$"):
        with_concrete_dtype(model)


@pytest.mark.parametrize(("change", "message"), [
    ({"distributed": {"pp_size": 2}}, "distributed.pp_size: 2 is not supported by remat"),
    ({"loss_fn": {"_target_": "nemo_automodel.components.loss.te_parallel_ce.TEParallelCrossEntropy",
                  "reduction": "mean"}},
     "loss_fn: reduction='mean' of TEParallelCrossEntropy; remat reads it at NeMo's defaults only"),
    ({"loss_fn": {"_target_": "nemo_automodel.components.loss.chunked_ce.ChunkedCrossEntropy"}},
     "loss_fn._target_: 'nemo_automodel.components.loss.chunked_ce.ChunkedCrossEntropy' has no remat "
     "counterpart; allowed: remat.loss.MaskedCrossEntropy, remat.loss.FusedLinearCrossEntropy"),
    ({"compile": {"enabled": True, "cache_size": 8}}, "compile.cache_size: not a torch.compile option remat passes"),
    ({"model": {"torch_dtype": "fp8"}}, "model.torch_dtype: got 'fp8'; allowed:"),
    ({"packed_sequence": {"packed_sequence_size": "1k"}}, "packed_sequence.packed_sequence_size: got '1k'; allowed:"),
    ({"dist_env": {"timeout_minutes": "ten"}}, "dist_env.timeout_minutes: got 'ten'; allowed: a positive number"),
    ({"lr_scheduler": {"min_lr": "low"}}, "lr_scheduler.min_lr: got 'low'; allowed: a number >= 0"),
    ({"optimizer": {"_target_": "nemo_automodel.components.optim.Fancy"}},
     "optimizer._target_: 'nemo_automodel.components.optim.Fancy' is NeMo AutoModel's own class"),
    ({"distributed": {"pipeline": {"pp_size": 4}}}, "distributed.pipeline: pp_size=4 asks for pipeline parallelism"),
    ({"distributed": {"moe": {"ep_size": 8}}}, "distributed.moe: ep_size=8 asks for expert parallelism"),
    ({"distributed": {"mp_policy": {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.bfloat16"}}},
     "distributed.mp_policy: {'param_dtype': 'torch.bfloat16', 'reduce_dtype': 'torch.bfloat16'}; remat's"),
    ({"checkpoint": {"model_save_format": "pickle"}}, "checkpoint.model_save_format: 'pickle'; allowed:"),
])
def test_what_remat_cannot_read_is_one_line_naming_the_key(change: dict[str, dict[str, object]],
                                                           message: str) -> None:
    data = yaml.safe_load((HERE / "llama_packed_fused.yaml").read_text())
    for section, values in change.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ConfigError) as info:
        from_nemo(data)
    first, *lines = str(info.value).splitlines()
    assert first == "a NeMo AutoModel recipe with keys remat cannot read as written:"
    assert [line for line in lines if line.startswith(message)], lines


def test_only_nemo_recipes_are_translated() -> None:
    assert is_nemo_recipe({"rng": {"seed": 1}}) and is_nemo_recipe({"loss_fn": {"_target_": "nemo_automodel.x.Y"}})
    assert not is_nemo_recipe(yaml.safe_load((HERE.parents[2] / "examples" / "quickstart.yaml").read_text()))


def test_nemo_keys_that_ask_for_nothing_remat_lacks_are_mapped_or_dropped_with_a_line() -> None:
    data = yaml.safe_load((HERE / "llama_packed_fused.yaml").read_text())
    data["distributed"] = {**data.get("distributed", {}), "pipeline": {"pp_size": 1}, "moe": {"ep_size": 1},
                           "mp_policy": {"_target_": "torch.distributed.fsdp.MixedPrecisionPolicy",
                                         "param_dtype": "torch.bfloat16", "reduce_dtype": "torch.float32"}}
    data["checkpoint"] = {**data.get("checkpoint", {}), "model_save_format": "torch_save",
                          "dequantize_base_checkpoint": False}
    data["distributed"]["strategy"] = "megatron_fsdp"
    data["distributed"].pop("activation_checkpointing", None)
    data["parallelizer"] = {"_target_": "nemo_automodel.components.moe.parallelizer.parallelize_model",
                            "activation_checkpointing": False}
    data["step_scheduler"] = {**data.get("step_scheduler", {}), "gc_every_steps": 100}
    out, said = from_nemo(data)
    assert out["distributed"]["mixed_precision"] == "bfloat16" and out["distributed"]["strategy"] == "fsdp2"
    assert out["distributed"]["activation_checkpointing"] is False and "parallelizer" not in out
    assert not {"pipeline", "moe", "mp_policy"} & set(out["distributed"])
    assert "gc_every_steps" not in out["step_scheduler"] and "model_save_format" not in out["checkpoint"]
    for start in ("distributed.mp_policy (param_dtype bfloat16, reduce_dtype float32) -> distributed.mixed_precision",
                  "distributed.pipeline: dropped", "distributed.moe: dropped",
                  "checkpoint.model_save_format torch_save: remat writes safetensors instead",
                  "checkpoint.dequantize_base_checkpoint false: dropped", "step_scheduler.gc_every_steps 100: dropped",
                  "distributed.strategy megatron_fsdp -> fsdp2 (PyTorch's FSDP2: the same sharding",
                  "parallelizer._target_ parallelize_model (NeMo's MoE parallelizer) -> remat's own sharding",
                  "parallelizer.activation_checkpointing false -> distributed.activation_checkpointing"):
        assert any(line.startswith(start) for line in said), (start, said)


@pytest.mark.parametrize(("source", "expected"), [(None, None), ("SAME", None), ("/data/tokenizer", "/data/tokenizer")])
def test_nemo_s_auto_tokenizer_is_the_model_s_own_or_a_tokenizer_path(source: str | None,
                                                                       expected: str | None) -> None:
    data = yaml.safe_load((HERE / "llama_packed_fused.yaml").read_text())
    model_source = data["model"].get("pretrained_model_name_or_path")
    data["tokenizer"] = {"_target_": "nemo_automodel._transformers.auto_tokenizer.NeMoAutoTokenizer.from_pretrained"}
    if source is not None:
        data["tokenizer"]["pretrained_model_name_or_path"] = model_source if source == "SAME" else source
    out, said = from_nemo(data)
    assert out.get("tokenizer") == ({"path": expected} if expected else None)
    assert any(line.startswith("tokenizer (NeMoAutoTokenizer") for line in said)


def test_nemo_s_wildcard_lora_targets_and_exclusions_adapt_the_modules_they_name() -> None:
    """peft.target_modules '*_proj' and exclude_modules ['*.o_proj'] (NeMo's wildcards) become PEFT's regular
    expressions: every projection but o_proj is adapted."""
    from tiny import tiny_causal_lm

    from remat.recipes.build import apply_lora
    from remat.recipes.loader import validate_recipe

    data = yaml.safe_load((HERE / "llama_packed_fused.yaml").read_text())
    data["peft"] = {"_target_": "nemo_automodel.components._peft.lora.PeftConfig", "target_modules": "*_proj",
                    "exclude_modules": ["*.o_proj"], "dim": 4, "alpha": 8}
    out, said = from_nemo(data)
    assert any(line.startswith("peft.target_modules ['*_proj'] (wildcards) -> the regular expression") for line in said)
    cfg = validate_recipe(out)
    model = apply_lora(tiny_causal_lm(hidden_size=32, intermediate_size=64, vocab_size=100), cfg.peft)
    adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if "lora_A" in name}
    assert adapted == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"}, adapted


def test_a_command_that_reads_no_data_sets_nemo_s_dataset_builders_aside(caplog: pytest.LogCaptureFixture) -> None:
    """remat estimate / plan of the published SQuAD recipe: its dataset builders are not read (they would be refused
    for training), its validation keys go with them, and the rest of the recipe is read as written."""
    caplog.set_level("INFO", logger="remat.recipes.loader")
    cfg = load_recipe(HERE / "llama_squad.yaml", ["--model.pretrained_model_name_or_path", "null", "--model.preset",
                                                   "tiny-llama", "--dataset.seq_length", "128"], data_needed=False)
    assert cfg.dataset.path is None and cfg.dataset.seq_length == 128 and cfg.validation_dataset is None
    assert cfg.step_scheduler.val_every_steps is None and cfg.step_scheduler.num_epochs == 1
    assert "NeMo AutoModel recipe: dataset._target_ make_squad_dataset: not read (this command reads no data)" in (
        caplog.text)


def test_remat_estimate_of_the_published_recipe_reads_only_the_cached_config(tmp_path: Path) -> None:
    """`remat estimate` of the NeMo SQuAD recipe as written, offline: the model's config.json from the HF cache (a
    tiny stand-in under meta-llama/Llama-3.2-1B; no weights, no tokenizer), its dataset builders set aside (no
    datasets cache exists: nothing is read), the step estimated."""
    from processes import run_bounded

    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.2-1B" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 8192,
        "torch_dtype": "bfloat16"}))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "home"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = run_bounded([sys.executable, "-m", "remat.cli", "estimate", str(HERE / "llama_squad.yaml"), "--target",
                        "cpu", "--seq-length", "64", "--json", str(tmp_path / "estimate.json")], env=env, cwd=tmp_path,
                       timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    estimate = json.loads((tmp_path / "estimate.json").read_text())
    rows = estimate if isinstance(estimate, list) else estimate.get("estimates", [estimate])
    assert rows and all(row["peak_bytes"] > 0 for row in rows)
    assert "dataset._target_ make_squad_dataset: not read (this command reads no data)" in proc.stderr
    # no tokenizer is cached: the model config's vocabulary, said in one line (not transformers' loader message)
    assert ("the tokenizer of meta-llama/Llama-3.2-1B does not load here (not in the HF cache, or the repository has "
            "none): estimating with the model config's vocabulary") in proc.stderr
    assert "builtin tokenizer" not in proc.stderr and "Couldn't instantiate" not in proc.stderr
    assert all(row["settings"]["vocab_size"] in (None, 8192) for row in rows)
    assert not (tmp_path / "home" / "datasets").exists()


def test_transformer_engines_cross_entropy_at_nemos_defaults_is_remats_masked_loss_and_an_unknown_loss_said_once(
        ) -> None:
    data = yaml.safe_load((HERE / "llama_squad.yaml").read_text())
    data["loss_fn"] = {"_target_": "nemo_automodel.components.loss.te_parallel_ce.TEParallelCrossEntropy",
                       "ignore_index": -100}
    out, said = from_nemo(data, data_needed=False)
    assert out["loss_fn"] == {"_target_": "remat.loss.MaskedCrossEntropy"}
    assert any(line.startswith("loss_fn._target_ nemo_automodel.components.loss.te_parallel_ce.TEParallelCrossEntropy"
                               " -> remat.loss.MaskedCrossEntropy (the same loss") for line in said)
    data["loss_fn"] = {"_target_": "nemo_automodel.components.loss.chunked_ce.ChunkedCrossEntropy"}
    with pytest.raises(ConfigError) as info:
        from_nemo(data, data_needed=False)
    assert sum(line.startswith("loss_fn._target_") for line in str(info.value).splitlines()) == 1


def test_nemos_tokenizer_flags_for_bos_and_eos_are_what_remat_does_and_their_refusal_is_said_once() -> None:
    data = yaml.safe_load((HERE / "llama_squad.yaml").read_text())
    data["tokenizer"] = {"_target_": "nemo_automodel.NeMoAutoTokenizer.from_pretrained",
                         "pretrained_model_name_or_path": data["model"]["pretrained_model_name_or_path"],
                         "add_bos_token": True, "add_eos_token": True}
    out, said = from_nemo(data, data_needed=False)
    assert "tokenizer" not in out
    assert "tokenizer: add_bos_token, add_eos_token true dropped (remat puts BOS in front of every document and EOS " \
           "at its end)" in said
    data["tokenizer"].update(add_eos_token=False, padding_side="left")
    with pytest.raises(ConfigError) as info:
        from_nemo(data, data_needed=False)
    lines = [line for line in str(info.value).splitlines() if line.startswith("tokenizer")]
    assert lines == ["tokenizer.add_eos_token: False; remat puts BOS in front of every document and EOS at its end; "
                     "allowed: true (or remove the key)",
                     "tokenizer: padding_side of NeMoAutoTokenizer have no remat counterpart; allowed: "
                     "pretrained_model_name_or_path (remat loads that tokenizer as it is)"], lines


def test_an_estimate_answers_for_the_layout_remat_would_run_and_training_refuses_it() -> None:
    """NOTE [ The estimate of what remat would run ]: pipeline and expert parallelism, sequence parallelism and
    Transformer Engine's FusedAdam become FSDP2 over the same GPUs and AdamW for `remat estimate`, each said with
    what the estimate leaves out; `remat finetune` refuses them by name, pointing at that estimate."""
    data = yaml.safe_load((HERE / "llama_squad.yaml").read_text())
    data["distributed"].update(dp_size=2, tp_size=2, pp_size=4, ep_size=8, sequence_parallel=True,
                               pipeline={"pp_schedule": "interleaved1f1b", "pp_size": 4})
    data["optimizer"] = {"_target_": "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam", "lr": 2e-5,
                         "betas": [0.9, 0.95], "master_weights": True, "exp_avg_dtype": "torch.float32",
                         "store_param_remainders": True}
    out, said = from_nemo(data, data_needed=False)
    assert out["distributed"]["dp_size"] == 8 and out["distributed"]["tp_size"] == 2
    assert not {"pp_size", "ep_size", "sequence_parallel", "pipeline"} & set(out["distributed"])
    assert out["optimizer"] == {"_target_": "torch.optim.AdamW", "lr": 2e-5, "betas": [0.9, 0.95]}
    assert ("distributed.pp_size 4: estimated as FSDP2 over the same GPUs, the pipeline stages' ranks data-parallel "
            "(dp_size 2 -> 8); remat has no pipeline parallelism") in said
    assert ("distributed.ep_size 8: estimated as FSDP2 over the same GPUs, the experts sharded over the data-parallel "
            "ranks like every other layer; remat has no expert parallelism") in said
    assert any(line.startswith("distributed.sequence_parallel: estimated without it") for line in said)
    assert ("optimizer._target_ transformer_engine FusedAdam: estimated as torch.optim.AdamW (moments in the "
            "parameters' dtype); its float32 master weights and moments in exp_avg_dtype are not in this estimate"
            ) in said
    with pytest.raises(ConfigError) as info:
        from_nemo(data)
    lines = str(info.value).splitlines()[1:]
    assert [line.split(":", 1)[0] for line in lines if line.startswith("distributed.")] == [
        "distributed.pipeline", "distributed.pp_size", "distributed.ep_size", "distributed.sequence_parallel"]
    assert "FSDP2 over the same GPUs instead (remat estimate RECIPE says what that layout holds per GPU)" in (
        str(info.value))


def test_a_config_loaded_from_the_model_s_own_checkpoint_is_that_checkpoint_s() -> None:
    data = yaml.safe_load((HERE / "llama_squad.yaml").read_text())
    data["model"]["config"] = {"_target_": "transformers.AutoConfig.from_pretrained",
                               "pretrained_model_name_or_path": data["model"]["pretrained_model_name_or_path"],
                               "trust_remote_code": True, "attn_implementation_new": "flash_attention_2",
                               "_attn_implementation": "flash_attention_2"}
    out, said = from_nemo(data)
    assert "config" not in out["model"] and out["model"]["attn_implementation"] == "sdpa"
    assert ("model.config (AutoConfig.from_pretrained of the same checkpoint): dropped (remat builds from that "
            "checkpoint's config.json); its attention implementation -> model.attn_implementation") in said
    data["model"]["config"]["pretrained_model_name_or_path"] = "other/model"  # another checkpoint's: not dropped
    assert from_nemo(data)[0]["model"]["config"]["pretrained_model_name_or_path"] == "other/model"


def test_nemo_s_wandb_section_is_logging_wandb_unless_it_is_switched_off() -> None:
    data = yaml.safe_load((HERE / "llama_packed_fused.yaml").read_text())
    data["wandb"] = {"enable": True, "project": "p", "entity": "e", "name": "n", "group": "g", "tags": ["t"],
                     "dir": "logs/wandb"}
    out, said = from_nemo(data)
    assert out["logging"]["wandb"] == {"project": "p", "entity": "e", "name": "n", "group": "g", "tags": ["t"]}
    assert "wandb -> logging.wandb (dir dropped: wandb writes in the run's output_dir)" in said
    data["wandb"]["enable"] = False  # NeMo's recipes ship W&B switched off: remat must not log to it either
    out, said = from_nemo(data)
    assert "wandb" not in out.get("logging", {})
    assert any(line.startswith("wandb: dropped (enable: false") for line in said)
    data["wandb"] = {"project": "p", "notes": "x"}
    with pytest.raises(ConfigError, match="wandb.notes: not a Weights & Biases setting remat passes"):
        from_nemo(data)


def test_nemo_s_mock_builder_is_dataset_mock() -> None:
    data = yaml.safe_load((HERE / "llama_mock_compile.yaml").read_text())
    out, said = from_nemo(data)
    assert out["dataset"] == {"mock": {"num_sentences": 32, "mean_len": 96, "std_len": 8, "vocab_size": 100,
                                       "max_sentence_len": 128, "seed": 4},
                              "format": "tokens", "packing": False, "seq_length": 144, "shuffle": False}
    assert any(line.startswith("dataset._target_ build_unpacked_dataset -> dataset.mock") for line in said)
    data["dataset"]["num_samples"] = 5
    with pytest.raises(ConfigError, match="dataset.num_samples: not an argument of NeMo's mock builder remat reads"):
        from_nemo(data)
