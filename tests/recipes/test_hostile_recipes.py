"""Hostile or malformed recipe files and JSONL rows: each is one line naming the file and the limit, within seconds,
never a hang, a traceback or gigabytes of memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from processes import within

from remat.data.config import DatasetConfig
from remat.data.sources import MAX_ROW_BYTES, iter_rows
from remat.errors import ConfigError
from remat.recipes.loader import MAX_RECIPE_BYTES, MAX_RECIPE_DEPTH, MAX_RECIPE_VALUES, load_recipe_data, read_yaml

BASE = {"model": {"preset": "tiny-llama"}, "dataset": {"seq_length": 32},
        "step_scheduler": {"global_batch_size": 2, "local_batch_size": 2, "max_steps": 1}}


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for level in range(1, levels + 1):
        lines.append(f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(("text", "message"), [
    (_alias_bomb(), f"expands to more than {MAX_RECIPE_VALUES:,} values (through its aliases)"),
    ("a: " + "[" * 200 + "]" * 200 + "\n", f"nests deeper than {MAX_RECIPE_DEPTH} levels"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nests deeper than"),
    ("# " + "x" * (MAX_RECIPE_BYTES + 10) + "\n", f"holds {MAX_RECIPE_BYTES + 13:,} bytes; allowed: at most "
                                                   f"{MAX_RECIPE_BYTES:,}"),
    ("? [a, b]\n: 1\n", "is not valid YAML at line 1, column 3: a key must be text or a number, not a list"),
    ("a: &x\n  b: *x\n", "has an alias that refers to itself (line 1)"),
])
def test_hostile_yaml_is_one_line_in_seconds(text: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    start = time.perf_counter()
    with within(20), pytest.raises(ConfigError) as info:
        read_yaml(path)
    assert time.perf_counter() - start < 10
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_escape_sequence_in_a_key_is_named_not_echoed(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE) + '"\\e[31mred": 1\n')
    with pytest.raises(ConfigError) as info:
        from remat.recipes.loader import validate_recipe

        validate_recipe(load_recipe_data(path))
    message = str(info.value)
    assert "\x1b" not in message and "unknown key" in message


def test_a_fifo_as_the_recipe_is_refused_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "recipe.yaml")
    with within(10), pytest.raises(ConfigError, match=r"recipe .* is a FIFO \(named pipe\); allowed: a regular file"):
        read_yaml(tmp_path / "recipe.yaml")


def test_a_recipe_path_with_a_nul_byte_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"recipe 'reci\\x00pe.yaml' not found"):
        read_yaml("reci\x00pe.yaml")
    with pytest.raises(ConfigError, match="not a usable path"):
        read_yaml("r" * 300 + "/recipe.yaml")


def _rows(path: Path) -> list[object]:
    return list(iter_rows(DatasetConfig(path=str(path), seq_length=32)))


def test_jsonl_rows_beyond_the_limits_are_one_line(tmp_path: Path) -> None:
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with within(20), pytest.raises(ConfigError, match=r"deep.jsonl line 1 nests deeper than Python's JSON reader"):
        _rows(deep)
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"text": "ok \\ud83d\\ude00"}\n{"text": "half \\ud800 of a pair"}\n')
    with pytest.raises(ConfigError, match=r"surrogate.jsonl line 2 holds the lone surrogate \\ud800"):
        _rows(surrogate)
    (tmp_path / "fifo.jsonl").unlink(missing_ok=True)
    os.mkfifo(tmp_path / "fifo.jsonl")
    with within(10), pytest.raises(ConfigError, match=r"fifo.jsonl' is a FIFO \(named pipe\)"):
        _rows(tmp_path / "fifo.jsonl")
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    with within(10), pytest.raises(ConfigError, match="zero.jsonl' is a character device"):
        _rows(tmp_path / "zero.jsonl")


@pytest.mark.slow
def test_a_row_longer_than_the_limit_is_refused_without_reading_the_rest(tmp_path: Path) -> None:
    huge = tmp_path / "huge.jsonl"
    with huge.open("wb") as handle:  # a sparse file: one line of twice the limit, then more
        handle.truncate(2 * MAX_ROW_BYTES)
    with within(30), pytest.raises(ConfigError, match=f"huge.jsonl line 1 is longer than {MAX_ROW_BYTES // 1024**2} MiB"):
        _rows(huge)


def test_the_cli_answers_an_alias_bomb_in_one_line_without_torch(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(yaml.safe_dump(BASE) + _alias_bomb())
    start = time.perf_counter()
    proc = subprocess.run([str(Path(sys.executable).parent / "remat"), "finetune", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert time.perf_counter() - start < 30
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "expands to more than" in proc.stderr
    assert json.dumps(sorted(p.name for p in tmp_path.iterdir())) == '["bomb.yaml"]'
