"""Hub ids, offline: the test lays a tiny Llama and its tokenizer out in the Hugging Face cache format
(``models--org--name/snapshots/<rev>/`` + ``refs/main``) under a temporary ``HF_HUB_CACHE``, sets
``HF_HUB_OFFLINE=1`` and loads ``org/name`` through a recipe (``load_recipe`` + one training step, tokenizer
included) and through ``remat.AutoModelForCausalLM.from_pretrained``; an id that is not cached gets one error line.
Nothing touches the network. huggingface_hub reads these variables at import, so the loads run in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from remat.data.tokenizer import builtin_tokenizer

REPO = "tiny-org/tiny-llama-hub"
REVISION = "0123456789abcdef0123456789abcdef01234567"
TOKENIZER_SIZE = 300  # not the recipe's tokenizer.vocab_size: a builtin tokenizer would show

SCRIPT = textwrap.dedent('''
    import json, sys
    import remat
    from remat.cli import main
    from remat.errors import ConfigError
    from remat.recipes.finetune import FinetuneRecipe
    from remat.recipes.loader import load_recipe

    recipe, missing_recipe, out = sys.argv[1:4]
    job = FinetuneRecipe(load_recipe(recipe))
    result = job.run()
    report = {"recipe": {"tokenizer": len(job.tokenizer), "model": type(job.model).__name__,
                         "final_step": result.final_step, "loss": result.records[-1].loss}}
    model = remat.AutoModelForCausalLM.from_pretrained("%s", activation_checkpointing="full")
    report["auto"] = {"weights": {n: p.double().sum().item() for n, p in model.named_parameters()},
                      "checkpointed": model.remat_plan.num_checkpointed}
    try:
        remat.AutoModelForCausalLM.from_pretrained("tiny-org/not-cached")
    except ConfigError as err:
        report["missing"] = str(err)
    report["cli_exit"] = main(["finetune", missing_recipe])
    report["estimate_exit"] = main(["estimate", recipe, "--target", "cpu", "--json", out + ".estimate.json"])
    report["estimate_hub_exit"] = main(["estimate", "%s", "--target", "cpu", "--seq-length", "32", "--json",
                                        out + ".hub.json"])
    report["estimate_missing_exit"] = main(["estimate", "tiny-org/not-cached", "--target", "cpu"])
    import contextlib, io
    plan_err = io.StringIO()
    with contextlib.redirect_stderr(plan_err):  # its own lines: the tests above count theirs
        report["plan_hub_exit"] = main(["plan", "%s", "--target", "cpu", "--seq-length", "64", "--batch-size",
                                        "2", "--budget", "64MiB", "--json", out + ".plan.json"])
        report["plan_missing_exit"] = main(["plan", "tiny-org/not-cached", "--target", "cpu", "--budget", "1GiB"])
        report["plan_recipe_flag_exit"] = main(["plan", recipe, "--batch-size", "2", "--budget", "1GiB"])
    report["plan_stderr"] = plan_err.getvalue()
    python_plan = remat.plan_activation_checkpointing("%s", memory_budget="64MiB", target="cpu", batch_size=2,
                                                      seq_length=64)
    report["python_plan_budget"] = python_plan.budget_bytes
    open(out, "w").write(json.dumps(report))
''' % (REPO, REPO, REPO, REPO))


def _populate_hub_cache(hub_cache: Path) -> dict[str, float]:
    """Write REPO at REVISION into `hub_cache` as huggingface_hub lays it out; return the weights' sums."""
    repo_dir = hub_cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / REVISION
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=TOKENIZER_SIZE)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(snapshot)
    builtin_tokenizer(TOKENIZER_SIZE).save_pretrained(snapshot)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(REVISION)
    return {n: p.double().sum().item() for n, p in model.named_parameters()}


def _recipe(path: Path, model_id: str, output_dir: Path) -> Path:
    path.write_text(json.dumps({  # JSON is YAML
        "seed": 3, "output_dir": str(output_dir), "model": {"pretrained_model_name_or_path": model_id},
        "dataset": {"seq_length": 32, "max_samples": 4},
        "step_scheduler": {"global_batch_size": 2, "local_batch_size": 2, "max_steps": 1},
        "loss_fn": {"_target_": "remat.loss.MaskedCrossEntropy"},
        "distributed": {"activation_checkpointing": True},
        "logging": {"progress": "plain"}, "checkpoint": {"enabled": False},
    }))
    return path


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, float], str]:
    root = tmp_path_factory.mktemp("hub")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root / "hub"), "HF_HOME": str(root / "home"),
           "REMAT_CACHE_DIR": str(root / "remat-cache"), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
               [str(Path(__file__).resolve().parents[2] / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_TOKEN", None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("REMAT_CACHE_DIR", env["REMAT_CACHE_DIR"])  # where this process trains the builtin tokenizer
        weights = _populate_hub_cache(root / "hub")
    recipe = _recipe(root / "recipe.yaml", REPO, root / "run")
    missing = _recipe(root / "missing.yaml", "tiny-org/not-cached", root / "run-missing")
    out = root / "report.json"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(recipe), str(missing), str(out)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads(out.read_text())
    report["estimate_json"] = str(out) + ".estimate.json"
    return report, weights, proc.stderr


def test_a_recipe_trains_a_cached_hub_model_offline(offline_run: tuple[dict[str, Any], dict[str, float], str]) -> None:
    report, _, _ = offline_run
    recipe = report["recipe"]
    assert recipe["model"] == "LlamaForCausalLM" and recipe["final_step"] == 1
    assert recipe["tokenizer"] == TOKENIZER_SIZE, "the Hub repo's own tokenizer, not the builtin one"
    assert 0 < recipe["loss"] < 10


def test_from_pretrained_loads_the_cached_weights(offline_run: tuple[dict[str, Any], dict[str, float], str]) -> None:
    report, weights, _ = offline_run
    assert report["auto"]["checkpointed"] == 2
    assert report["auto"]["weights"].keys() == weights.keys()
    for name, total in weights.items():
        assert report["auto"]["weights"][name] == pytest.approx(total, rel=1e-12), name


def test_the_estimate_reads_a_cached_hub_config_offline(
        offline_run: tuple[dict[str, Any], dict[str, float], str]) -> None:
    report, _, _ = offline_run
    assert report["estimate_exit"] == 0
    estimate = json.loads(Path(report["estimate_json"]).read_text())
    assert estimate["peak_bytes"] > 0


def test_an_uncached_hub_id_offline_is_one_line(offline_run: tuple[dict[str, Any], dict[str, float], str]) -> None:
    report, _, stderr = offline_run
    advice = ("(HF_HUB_OFFLINE is set and 'tiny-org/not-cached' is not in the Hugging Face cache (")
    message = report["missing"]
    assert message.startswith("model.pretrained_model_name_or_path: cannot read a transformers config for the Hub id "
                              f"'tiny-org/not-cached' {advice}")
    assert "`hf download tiny-org/not-cached`" in message and "\n" not in message
    assert report["cli_exit"] == 2  # the recipe stops at its first step that needs the repository: the tokenizer
    errors = [line for line in stderr.splitlines() if line.startswith("error: ") and "config.json" not in line]
    assert len(errors) == 1 and "Traceback" not in stderr and "WARNING" not in stderr
    assert errors[0].startswith("error: model.pretrained_model_name_or_path: cannot load the tokenizer for the Hub "
                                f"id 'tiny-org/not-cached' {advice}")


def test_remat_estimate_takes_a_hub_id_and_reads_only_its_cached_config(
        offline_run: tuple[dict[str, Any], dict[str, float], str]) -> None:
    """`remat estimate ORG/NAME ...` offline: the config.json from the HF cache, no weights; a Hub id that is not
    cached is one line naming HF_HUB_OFFLINE."""
    report, _, stderr = offline_run
    assert report["estimate_hub_exit"] == 0
    hub = json.loads(Path(report["estimate_json"].replace(".estimate.json", ".hub.json")).read_text())
    assert hub["parameters"] > 0 and hub["peak_bytes"] > 0
    assert report["estimate_missing_exit"] == 2
    (line,) = [line for line in stderr.splitlines() if "cannot read config.json" in line]
    assert line.startswith("error: model.pretrained_model_name_or_path: cannot read config.json for the Hub id "
                           "'tiny-org/not-cached' (HF_HUB_OFFLINE is set")


def test_remat_plan_takes_a_hub_id_with_the_step_from_its_flags(
        offline_run: tuple[dict[str, Any], dict[str, float], str]) -> None:
    """`remat plan ORG/NAME --budget ...` offline: the cached config.json only, the step from the flags; an uncached
    id is one line; step flags given with a recipe are refused."""
    report, _, _ = offline_run
    assert report["plan_hub_exit"] == 0
    plan = json.loads(Path(report["estimate_json"].replace(".estimate.json", ".plan.json")).read_text())
    (answer,) = plan["budgets"]
    assert answer["budget_bytes"] == 64 * 2**20 and 0 < answer["predicted_peak_bytes"] <= answer["budget_bytes"]
    assert plan["target"] == "cpu" and len(answer["blocks"]) > 0
    errors = [line for line in report["plan_stderr"].splitlines() if line.startswith("error: ")]
    assert report["plan_missing_exit"] == 2 and report["plan_recipe_flag_exit"] == 2
    assert errors[0].startswith("error: model.pretrained_model_name_or_path: cannot read config.json for the Hub id "
                                "'tiny-org/not-cached' (HF_HUB_OFFLINE is set")
    assert errors[1].startswith("error: --batch-size: sets the step of a Hub id or model directory; a recipe has its "
                                "own")
    assert report["python_plan_budget"] == 64 * 2**20  # plan_activation_checkpointing("org/name", ...) too


def test_an_unreachable_hub_is_one_line_in_seconds_and_the_cache_still_serves(tmp_path: Path) -> None:
    """Without HF_HUB_OFFLINE and with a Hub that does not answer (an endpoint on a closed local port): one WARNING
    line, then a cached id is estimated from the cache and an uncached one is one error line, with no retries (they
    took 25 s and some 30 lines per file)."""
    hub = tmp_path / "hub"
    _populate_hub_cache(hub)
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HOME": str(tmp_path / "home"),
           "HF_ENDPOINT": "http://127.0.0.1:9", "REMAT_CACHE_DIR": str(tmp_path / "remat-cache")}
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN"):
        env.pop(name, None)
    for model_id, exit_code in ((REPO, 0), ("tiny-org/not-cached", 2)):
        proc = subprocess.run([sys.executable, "-m", "remat.cli", "estimate", model_id, "--target", "cpu",
                               "--seq-length", "32"], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == exit_code, proc.stderr[-3000:]
        said = [line for line in proc.stderr.splitlines() if line.strip()]
        assert sum("the Hugging Face Hub (http://127.0.0.1:9) did not answer" in line for line in said) == 1, said
        assert not any("Retry" in line for line in said), said
        if exit_code:
            assert said[-1].startswith("error: model.pretrained_model_name_or_path: cannot read config.json for the "
                                       "Hub id 'tiny-org/not-cached' (the Hub did not answer and"), said
            assert len(said) == 2, said
