"""Hugging Face caches built without the network. A datasets cache holding tiny stand-ins of Hub datasets: what
``datasets.load_dataset(ORG/NAME, CONFIG)`` leaves in ``HF_DATASETS_CACHE`` after a download (the Arrow files and
``dataset_info.json`` of each split, under ``org___name/CONFIG/0.0.0/HASH``), which it reads back offline. A Hub cache
holding a model repository's config.json alone (no weights, no tokenizer), as ``hf download ORG/NAME config.json``
leaves it in ``HF_HUB_CACHE``."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def cache_hub_dataset(datasets_cache: Path, hub_id: str, splits: Mapping[str, Sequence[Mapping[str, Any]]], *,
                      config: str = "default") -> None:
    """Put ``splits`` (rows per split name) into ``datasets_cache`` as the Hub dataset ``hub_id`` (configuration
    ``config``), prepared by the datasets library's own Parquet builder as a download would be."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    name = hub_id.split("/")[-1]
    with tempfile.TemporaryDirectory() as work:
        files = {}
        for split, rows in splits.items():
            files[split] = str(Path(work) / f"{split}.parquet")
            datasets.Dataset.from_list(list(rows)).to_parquet(files[split])
        builder = Parquet(cache_dir=str(Path(work) / "prepared"), dataset_name=name, config_name=config,
                          data_files=files, hash="0" * 16)
        builder.download_and_prepare()
        prepared = Path(builder.cache_dir)
        target = Path(datasets_cache) / hub_id.replace("/", "___") / config / prepared.parts[-2] / prepared.parts[-1]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(prepared), str(target))


def cache_model_config(hub_cache: Path, hub_id: str, config: Mapping[str, Any]) -> None:
    """Put ``config`` into ``hub_cache`` as the config.json of the model repository ``hub_id`` (one snapshot, the
    ``main`` ref pointing at it), the layout huggingface_hub reads offline."""
    revision = "0" * 40
    repo = Path(hub_cache) / f"models--{hub_id.replace('/', '--')}"
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "snapshots" / revision / "config.json").write_text(json.dumps(dict(config)))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)


def llama_3_2_1b_config() -> dict[str, Any]:
    """meta-llama/Llama-3.2-1B's published config.json: remat's preset of that shape with the fields the file adds
    (its architecture and its dtype, bfloat16)."""
    from remat.models.presets import PRESETS

    return {"architectures": ["LlamaForCausalLM"], **PRESETS["llama-3.2-1b"].config, "torch_dtype": "bfloat16"}


SQUAD_ROWS: list[dict[str, Any]] = [
    {"id": str(i), "title": "t", "context": f"the city number {i} lies by the river",
     "question": f"where does city {i} lie", "answers": {"text": ["by the river"], "answer_start": [20]}}
    for i in range(24)
]
HELLASWAG_ROWS: list[dict[str, Any]] = [
    {"ind": i, "activity_label": "a", "ctx_a": "a man", "ctx_b": "walks", "ctx": f"a man walks {i} steps and",
     "endings": [" sits down.", " runs away.", " jumps.", " falls."], "source_id": "s", "split": "train",
     "split_type": "indomain", "label": str(i % 4)}
    for i in range(24)
]
