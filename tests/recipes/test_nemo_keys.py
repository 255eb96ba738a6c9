"""The NeMo-format recipes of tests/recipes/nemo/ (written here in NeMo AutoModel's schema, not copied) against the
recipes NVIDIA publishes: together they use every key of the published recipes remat reads as written (the inventory
`benchmarks/nemo_recipes.py` committed in benchmarks/results/nemo_recipes.json), each reads as written through
``--print-config``, and every Hub dataset each names builds, offline, from a datasets cache of tiny stand-ins through
the template NeMo's builder maps to."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from hub_datasets import HELLASWAG_ROWS, SQUAD_ROWS, cache_hub_dataset

from remat.cli import main
from remat.recipes.loader import load_recipe

HERE = Path(__file__).resolve().parent / "nemo"
ROOT = HERE.parents[2]
RECIPES = sorted(HERE.glob("*.yaml"))

#: A chat template that renders tools, turns and tool calls (what the tool-call datasets need of one).
CHAT_TEMPLATE = ("{% if tools %}tools: {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
                 "{% for m in messages %}{{ m.role }}: {{ m.content }} {% for c in m.tool_calls or [] %}call "
                 "{{ c.function.name }} {{ c.function.arguments }} {% endfor %}end {% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")

_TRACE = {"tools": json.dumps([{"type": "function", "function": {"name": "lookup", "parameters": {}}}]),
          "conversations": [{"from": "human", "value": "find the river"},
                            {"from": "function_call", "value": json.dumps({"name": "lookup", "arguments": {"q": 1}})},
                            {"from": "observation", "value": "by the sea"}, {"from": "gpt", "value": "by the sea"}]}
_XLAM = {"query": "how far is it", "answers": json.dumps([{"name": "distance", "arguments": {"to": "sea"}}]),
         "tools": json.dumps([{"name": "distance", "description": "d", "parameters": {"to": {"type": "str"}}}])}
#: (Hub id, configuration) -> splits: tiny rows of each dataset the recipes name, in its published layout.
STAND_INS: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {
    ("rajpurkar/squad", "plain_text"): {"train": SQUAD_ROWS, "validation": SQUAD_ROWS[:6]},
    ("rowan/hellaswag", "default"): {"train": HELLASWAG_ROWS, "validation": HELLASWAG_ROWS[:6]},
    ("remat-tests/instructions", "default"): {
        split: [{"passage": f"the city {i} lies by the river", "prompt": f"where is city {i}",
                 "completion": "by the river"} for i in range(12)] for split in ("train", "validation")},
    ("remat-tests/agent-traces", "default"): {"train": [{**_TRACE, "id": i} for i in range(24)]},
    ("Salesforce/xlam-function-calling-60k", "default"): {"train": [{**_XLAM, "id": i} for i in range(12)]},
}


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub is never asked (a probe would switch the whole test process offline)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_recipes_use_every_key_of_the_published_recipes_remat_reads(
        benchmark_script: Callable[[str], ModuleType]) -> None:
    recipe_keys = benchmark_script("nemo_recipes").recipe_keys
    published = set(json.loads((ROOT / "benchmarks" / "results" / "nemo_recipes.json").read_text())["accepted_keys"])
    ours = set().union(*(recipe_keys(yaml.safe_load(path.read_text())) for path in RECIPES))
    assert len(published) >= 180 and not published - ours, sorted(published - ours)


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.name)
def test_each_reads_as_written(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["finetune", str(path), "--print-config", "--output_dir", str(tmp_path / "run")]) == 0
    assert "error" not in capsys.readouterr().err


@pytest.fixture(scope="module")
def datasets_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hf")
    for (hub_id, config), splits in STAND_INS.items():
        cache_hub_dataset(home / "datasets", hub_id, splits, config=config)
    return home


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.name)
def test_each_named_dataset_builds_from_a_datasets_cache(path: Path, datasets_cache: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets.config
    from tiny import tiny_word_tokenizer

    from remat.data.dataset import build_dataset

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", datasets_cache / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # the recipes' chat_template files are relative paths
    (tmp_path / "templates").mkdir()
    for name in ("instructions.jinja", "agent.jinja"):
        (tmp_path / "templates" / name).write_text(CHAT_TEMPLATE)
    tokenizer = tiny_word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    cfg = load_recipe(path, ["--output_dir", str(tmp_path / "run")])
    built = []
    for key, section in (("dataset", cfg.dataset), ("validation_dataset", cfg.validation_dataset)):
        if section is None or (section.path is None and section.mock is None):
            continue
        dataset = build_dataset(section.model_copy(update={"seq_length": 48}), tokenizer, key_prefix=key)
        assert len(dataset) > 0, key
        if section.template in ("agent_chat", "xlam"):
            assert dataset.format == "messages"
        built.append(key)
    assert built or path.name == "llama_packed_fused.yaml", path.name  # that one trains on remat's builtin corpus


#: NeMo sections docs/recipes.md describes as a whole (read as they are, mapped or dropped with all their keys).
WHOLE_SECTIONS = ("fp8", "quantization", "ci", "skypilot", "wandb", "tool_call_eval", "parallelizer", "neftune",
                  "embedding_row_repair", "packed_sequence", "rng", "dist_env", "compile")


def test_the_docs_say_what_remat_does_with_every_key_of_every_published_recipe() -> None:
    """docs/recipes.md's NeMo section names each key of the 220 published recipes (the sweep's inventory): the key,
    a tail of its dotted name, or a section of two names and more it belongs to, in backticks; or its section is one
    the page describes as a whole."""
    import re

    published = json.loads((ROOT / "benchmarks" / "results" / "nemo_recipes.json").read_text())["published_keys"]
    page = (ROOT / "docs" / "recipes.md").read_text()
    section = page[page.index("## Coming from NeMo AutoModel"):]
    named = {part.rstrip(".") for quoted in re.findall(r"`([^`]+)`", section)
             for part in re.split(r"[\s,:{}()\[\]=]+", quoted) if part}

    def said(key: str) -> bool:
        parts = key.split(".")
        return (parts[0] in WHOLE_SECTIONS and parts[0] in named
                or any(".".join(parts[i:]) in named for i in range(len(parts)))
                or any(".".join(parts[:i]) in named for i in range(2, len(parts))))

    assert len(published) >= 300 and not [key for key in published if not said(key)], sorted(
        key for key in published if not said(key))
