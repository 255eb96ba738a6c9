"""Reading raw rows: JSONL files, directories of them, `datasets.save_to_disk` directories, the builtin corpus.

Every row keeps a human-readable location ("data.jsonl line 7", "ds[train] row 3") so that a bad row can be named.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import random
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remat._files import open_regular, read_regular_bytes
from remat.data.config import DatasetConfig, MockConfig
from remat.data.corpus import builtin_documents
from remat.errors import ConfigError
from remat.hub import hub_load_error, is_hub_id, offline_unless_reachable

logger = logging.getLogger(__name__)

_HF_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")
_JSONL_SUFFIX = ".jsonl"
#: The longest JSONL row read (one line); a longer one is refused in one line instead of filling memory.
MAX_ROW_BYTES = 64 * 1024**2
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class RawRow:
    """One record from a source, and where it came from (for error messages)."""

    data: Mapping[str, Any]
    where: str


def _is_hf_dataset_dir(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in _HF_MARKERS)


def _read_jsonl(path: Path, key: str) -> Iterator[RawRow]:
    # Bytes, decoded per line, so that a non-UTF-8 line is named; only a regular file (a FIFO or /dev/zero behind
    # the name is refused, not read forever), one line of at most MAX_ROW_BYTES at a time.
    with open_regular(path, f"{key}:") as handle:
        for number in itertools.count(1):
            raw = handle.readline(MAX_ROW_BYTES + 1)
            if not raw:
                break
            where = f"{path} line {number}"
            if len(raw) > MAX_ROW_BYTES and not raw.endswith(b"\n"):
                raise ConfigError(f"{key}: {where} is longer than {MAX_ROW_BYTES // 1024**2} MiB; allowed: rows of "
                                  f"at most {MAX_ROW_BYTES // 1024**2} MiB, one JSON object per line")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{key}: {where} is not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                                  f"{exc.start + 1}); JSON lines files are UTF-8") from None
            del raw
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{key}: {where} is not valid JSON ({exc.msg} at column {exc.colno})") from exc
            except RecursionError:
                raise ConfigError(f"{key}: {where} nests deeper than Python's JSON reader goes (about "
                                  f"{sys.getrecursionlimit()} levels); allowed: rows of plain fields and message "
                                  "lists") from None
            escapes = _SURROGATE_ESCAPE.search(line) is not None
            del line  # a long line is not held twice (as the line and as the parsed string) while the row is used
            if not isinstance(data, dict):
                raise ConfigError(f"{key}: {where} must be a JSON object, got {type(data).__name__}")
            if escapes and (lone := _lone_surrogate(data)) is not None:
                raise ConfigError(f"{key}: {where} holds the lone surrogate \\u{ord(lone):04x}, which is not text "
                                  "(half of a pair); allowed: valid Unicode")
            yield RawRow(data, where)


def _lone_surrogate(value: Any) -> str | None:
    """The first unpaired UTF-16 surrogate in the strings of a parsed row (JSON's ``\\ud800`` escapes), or None."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found is not None:
                return found.group()
        elif isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return None


#: The largest ``state.json`` / ``dataset_dict.json`` of a saved dataset remat reads (they list file names).
_SAVED_INDEX_LIMIT = 1 << 20


def _check_saved_dataset(path: Path, key: str) -> None:
    """ConfigError when a ``save_to_disk`` directory's index names a file that is not a plain name inside it, or one
    that is not a regular file there (a link, a FIFO): `datasets.load_from_disk` would open whatever it names."""
    splits_file = path / "dataset_dict.json"
    if splits_file.exists() or splits_file.is_symlink():
        splits = _saved_index(splits_file, key).get("splits")
        if not isinstance(splits, list) or not all(isinstance(name, str) for name in splits):
            raise ConfigError(f"{key}: {splits_file} lists no splits; allowed: a datasets save_to_disk directory")
        for name in splits:
            _check_saved_dataset(_plain_entry(path, name, splits_file, key), key)
        return
    state_file = path / "state.json"
    if not (state_file.exists() or state_file.is_symlink()):
        return  # not a saved Dataset: load_from_disk says so itself
    files = _saved_index(state_file, key).get("_data_files")
    if not isinstance(files, list) or not all(isinstance(entry, dict) for entry in files):
        raise ConfigError(f"{key}: {state_file} lists no data files; allowed: a datasets save_to_disk directory")
    for entry in files:
        data = _plain_entry(path, entry.get("filename"), state_file, key)
        open_regular(data, key, follow_symlinks=False).close()


def _saved_index(file: Path, key: str) -> dict[str, Any]:
    try:
        index = json.loads(read_regular_bytes(file, key, limit=_SAVED_INDEX_LIMIT, follow_symlinks=False))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ConfigError(f"{key}: {file} is not valid JSON ({type(err).__name__})") from None
    if not isinstance(index, dict):
        raise ConfigError(f"{key}: {file} is not a JSON object; allowed: a datasets save_to_disk directory")
    return index


def _plain_entry(path: Path, name: Any, index: Path, key: str) -> Path:
    """``path / name`` for a plain file or folder name of a saved dataset's index; ConfigError for anything else."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise ConfigError(f"{key}: {index} names {name!r}, not a plain name inside {path}; allowed: the files a "
                          "datasets save_to_disk wrote there (refused unread)")
    return path / name


def _read_hf_dataset(path: Path, split: str, split_given: bool, key_prefix: str) -> Iterator[RawRow]:
    import datasets  # imported here: loading `datasets` costs about a second

    _check_saved_dataset(path, f"{key_prefix}.path")
    try:
        loaded = datasets.load_from_disk(str(path))
    except (OSError, ValueError, TypeError, KeyError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ConfigError(f"{key_prefix}.path: {path} is not a dataset that datasets.load_from_disk reads "
                          f"({type(err).__name__}: {' '.join(str(err).split())[:200]}); allowed: a save_to_disk "
                          "directory, or JSONL") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(
                f"{key_prefix}.split: {path} has splits {sorted(loaded)}; got {split!r}"
                + ("" if split_given else f" (the default for {key_prefix}; set {key_prefix}.split)")
            )
        table, label = loaded[split], f"{path}[{split}]"
    else:
        if split_given:
            raise ConfigError(
                f"{key_prefix}.split: {path} is a single Dataset without splits; got split {split!r}, "
                "remove the key or point at a DatasetDict"
            )
        table, label = loaded, str(path)
    for index, data in enumerate(table):
        yield RawRow(data, f"{label} row {index}")


def _jsonl_files_in(directory: Path, key: str) -> list[Path]:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix == _JSONL_SUFFIX)
    if not files:
        raise ConfigError(
            f"{key}: directory {directory} has no {_JSONL_SUFFIX} files and is not a datasets.save_to_disk directory"
        )
    return files


_ALLOWED_PATHS = (f"a {_JSONL_SUFFIX} file, a directory of them, a datasets.save_to_disk directory, or a Hugging "
                  "Face Hub dataset id (org/name)")
#: File suffixes that mark a path as a file name, never a Hub dataset id.
_FILE_SUFFIXES: tuple[str, ...] = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt")


def is_hub_dataset(raw: str) -> bool:
    """Whether a ``dataset.path`` that is not on the local disk names a Hugging Face Hub dataset: shaped like a Hub
    id (``org/name`` or ``name``), not like a file name or an explicit path (``./``, ``/``, ``~``)."""
    return (not Path(raw).expanduser().exists() and is_hub_id(raw)
            and not raw.lower().endswith(_FILE_SUFFIXES))


@contextlib.contextmanager
def _datasets_quiet() -> Iterator[None]:
    """The datasets library's own warnings (which cached copy it found, in two lines) and progress bars off while it
    loads: remat says where the rows came from in one line."""
    import datasets

    level = datasets.logging.get_verbosity()
    bars = datasets.utils.are_progress_bars_disabled()
    datasets.logging.set_verbosity_error()
    datasets.utils.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if not bars:
            datasets.utils.enable_progress_bars()


def _read_hub_dataset(hub_id: str, cfg: DatasetConfig, split: str, key_prefix: str, key: str) -> Iterator[RawRow]:
    """The rows of a Hub dataset's split, loaded by `datasets.load_dataset` (downloaded once into the HF cache, read
    from it offline). The datasets library runs no code of a dataset's (scripts are refused by it), and remat asks for
    none: one line when it cannot be loaded."""
    offline_unless_reachable()
    import datasets

    try:
        with _datasets_quiet():
            loaded = datasets.load_dataset(hub_id, cfg.name, split=split, revision=cfg.revision)
    except (OSError, ValueError, RuntimeError, TypeError) as err:  # ConnectionError, DatasetNotFoundError: OSError
        message = " ".join(str(err).split())
        if "Unknown split" in message or "Bad split" in message:
            raise ConfigError(f"{key_prefix}.split: {split!r} is not a split of the Hub dataset {hub_id!r} "
                              f"({message[:300]})") from None
        if "scripts are no longer supported" in message:
            raise ConfigError(f"{key}: the Hub dataset {hub_id!r} is a loading script, which is code; remat runs no "
                              "dataset's code: allowed: a Hub dataset of data files (Parquet, JSON, CSV)") from None
        config = f" (configuration {cfg.name!r})" if cfg.name else ""
        raise hub_load_error(key, hub_id, f"load the dataset{config}", err, repo_type="dataset") from None
    label = f"{hub_id}{f'/{cfg.name}' if cfg.name else ''}[{split}]"
    logger.info("%s: the Hub dataset %s, %d rows (%s)", key, label, len(loaded),
                "from the HF cache, offline" if datasets.config.HF_HUB_OFFLINE else "downloaded or cached")
    for index, data in enumerate(loaded):
        yield RawRow(data, f"{label} row {index}")


def check_paths_exist(cfg: DatasetConfig, key_prefix: str = "dataset") -> None:
    """ConfigError naming the key when a path of the section does not exist (light: the command line checks it
    before torch loads; reading the rows checks it again)."""
    for raw, key in zip(cfg.paths or [], _path_keys(cfg, key_prefix), strict=False):
        if not Path(raw).expanduser().exists() and not is_hub_dataset(raw):
            raise ConfigError(f"{key}: {raw!r} does not exist; expected {_ALLOWED_PATHS}")


def _path_keys(cfg: DatasetConfig, key_prefix: str) -> list[str]:
    if isinstance(cfg.path, str):
        return [f"{key_prefix}.path"]
    return [f"{key_prefix}.path[{i}]" for i in range(len(cfg.paths or []))]


def _rows_of_path(raw: str, cfg: DatasetConfig, split: str, key_prefix: str, key: str) -> Iterator[RawRow]:
    path = Path(raw).expanduser()
    allowed = _ALLOWED_PATHS
    if is_hub_dataset(raw):
        yield from _read_hub_dataset(raw, cfg, split, key_prefix, key)
        return
    for name, what in (("name", "configuration"), ("revision", "revision")):
        if getattr(cfg, name) is not None:
            raise ConfigError(f"{key_prefix}.{name}: {getattr(cfg, name)!r} is a Hub dataset's {what}; {raw!r} is on "
                              "the local disk; allowed: remove the key, or path: a Hub dataset id")
    if not path.exists():
        raise ConfigError(f"{key}: {raw!r} does not exist; expected {allowed}")
    if _is_hf_dataset_dir(path):
        yield from _read_hf_dataset(path, split, cfg.split is not None, key_prefix)
        return
    if cfg.split is not None:
        raise ConfigError(
            f"{key_prefix}.split: {raw!r} is JSONL, which has no splits; got split {cfg.split!r}, remove the key"
        )
    if path.is_dir():
        for file in _jsonl_files_in(path, key):
            yield from _read_jsonl(file, key)
    elif path.suffix == _JSONL_SUFFIX:
        yield from _read_jsonl(path, key)
    else:
        raise ConfigError(f"{key}: {raw!r} is not a {_JSONL_SUFFIX} file; expected {allowed}")


def _mock_rows(cfg: MockConfig) -> Iterator[RawRow]:
    """`MockConfig`'s rows: ``{"input_ids": [...]}``, the same ids NeMo AutoModel's mock builder draws for a seed."""
    draw = random.Random(cfg.seed)
    ids = range(2, cfg.vocab_size)
    for index in range(cfg.num_sentences):
        length = max(1, min(cfg.max_sentence_len, int(draw.gauss(cfg.mean_len, cfg.std_len))))
        yield RawRow({"input_ids": [*draw.choices(ids, k=length), 1]}, f"mock row {index}")


def iter_rows(cfg: DatasetConfig, *, default_split: str = "train", key_prefix: str = "dataset") -> Iterator[RawRow]:
    """The rows the config names, in order, read lazily and cut to `cfg.max_samples`; the builtin corpus yields
    `{"text": ...}`."""
    split = cfg.split if cfg.split is not None else default_split
    paths = cfg.paths
    if cfg.mock is not None:
        rows: Iterator[RawRow] = _mock_rows(cfg.mock)
    elif paths is None:
        documents = builtin_documents(split, key=f"{key_prefix}.split")
        rows = (
            RawRow({cfg.text_field: text}, f"builtin corpus[{split}] document {index}")
            for index, text in enumerate(documents)
        )
    else:
        keys = _path_keys(cfg, key_prefix)
        rows = itertools.chain.from_iterable(
            _rows_of_path(raw, cfg, split, key_prefix, key) for raw, key in zip(paths, keys, strict=True)
        )
    return itertools.islice(rows, cfg.max_samples)


def no_rows_message(cfg: DatasetConfig, key_prefix: str = "dataset") -> str:
    """The error for a source that holds no rows."""
    return f"{key_prefix}.path: {cfg.path!r} holds no rows"
