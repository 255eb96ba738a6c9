"""A Hugging Face datasets cache holding tiny stand-ins of Hub datasets, built without the network: what
``datasets.load_dataset(ORG/NAME, CONFIG)`` leaves in ``HF_DATASETS_CACHE`` after a download (the Arrow files and
``dataset_info.json`` of each split, under ``org___name/CONFIG/0.0.0/HASH``), which it reads back offline."""

from __future__ import annotations

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
