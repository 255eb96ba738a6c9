"""Long documents are tokenized in pieces: the same ids as in one call, in memory near that of short lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerBase

from remat.data import DatasetConfig, build_dataset
from remat.data.corpus import builtin_documents
from remat.data.encode import cut_points, encode_texts
from remat.data.formats import EncodedDocument

SRC = Path(__file__).resolve().parents[2] / "src"


def _corpus_text(chars: int) -> str:
    corpus = "\n\n".join(builtin_documents("train"))
    return (corpus * (chars // len(corpus) + 1))[:chars]


def test_cuts_fall_at_the_start_of_a_run_of_spaces_within_the_piece_size() -> None:
    text = _corpus_text(200_000)
    cuts = cut_points(text, 3000)
    bounds = [0, *cuts, len(text)]
    assert len(cuts) > 60
    assert all(0 < hi - lo <= 3000 for lo, hi in zip(bounds[:-1], bounds[1:], strict=False))
    assert all(text[cut] == " " and not text[cut - 1].isspace() for cut in cuts)
    assert cut_points("x" * 10 + " " * 20 + "y" * 5, 16) == [10, 26]  # inside the space run: a hard cut
    assert cut_points("z" * 25, 10) == [10, 20]  # no space at all: cut at the window's end
    assert cut_points("short", 10) == []


@pytest.mark.parametrize("piece_chars", [777, 4096])
def test_pieces_give_the_ids_and_offsets_of_one_call(builtin_tok: PreTrainedTokenizerBase, piece_chars: int) -> None:
    # Code, prose, runs of spaces and newlines, punctuation: the builtin corpus's help topics.
    text = _corpus_text(120_000) + "  trailing   spaces\n\n  and  more "
    whole = builtin_tok(text, add_special_tokens=False, return_offsets_mapping=True)
    (pieces,) = encode_texts(builtin_tok, [text], offsets=True, piece_chars=piece_chars)
    assert len(cut_points(text, piece_chars)) > 20
    assert pieces.ids.dtype == np.int32
    assert pieces.ids.tolist() == whole["input_ids"]
    assert pieces.starts is not None and pieces.starts.tolist() == [s for s, _ in whole["offset_mapping"]]


def test_a_long_text_row_packs_to_the_ids_of_the_unsplit_text(builtin_tok: PreTrainedTokenizerBase,
                                                               tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    text = _corpus_text(50_000)
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n")
    monkeypatch.setattr("remat.data.encode.PIECE_CHARS", 1000)  # 50 pieces
    dataset = build_dataset(DatasetConfig(path=str(path), seq_length=64, shuffle=False), builtin_tok)
    expected = [builtin_tok.bos_token_id, *builtin_tok(text, add_special_tokens=False)["input_ids"]]
    flat = dataset.tensors["input_ids"].reshape(-1).tolist()
    assert flat == expected[: len(flat)] and len(expected) - len(flat) < 64 + 1


def test_documents_hold_compact_arrays() -> None:
    document = EncodedDocument([5, 6, 7], [False, True, True])
    assert document.input_ids.dtype == np.int32 and document.loss_mask.dtype == np.bool_
    with pytest.raises(ValueError, match="equal 1-d arrays"):
        EncodedDocument([1, 2], [True])


# Peak RSS from VmHWM (this process's own address space): ru_maxrss starts at the parent's (pytest's) RSS.
_CHILD = r"""
import json, sys
from remat.data import DatasetConfig, build_dataset
from remat.data.tokenizer import load_tokenizer_from_path
def hwm_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
tokenizer = load_tokenizer_from_path(sys.argv[2])
base = hwm_kib()
dataset = build_dataset(DatasetConfig(path=sys.argv[1], seq_length=256, shuffle=False), tokenizer)
print(json.dumps({"growth_kib": hwm_kib() - base,
                  "tokens": int(dataset.tensors["input_ids"].numel())}))
"""


def _build_growth(path: Path, tokenizer_dir: Path) -> dict[str, int]:
    env = {"PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(tokenizer_dir)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_long_line_builds_in_memory_near_that_of_short_lines(builtin_tok: PreTrainedTokenizerBase,
                                                               tmp_path: Path) -> None:
    builtin_tok.save_pretrained(str(tmp_path / "tok"))
    text = _corpus_text(4_000_000)
    single, short = tmp_path / "single.jsonl", tmp_path / "short.jsonl"
    single.write_text(json.dumps({"text": text}) + "\n")
    cuts = [0, *cut_points(text, 2000), len(text)]
    short.write_text("".join(json.dumps({"text": text[lo:hi]}) + "\n" for lo, hi in zip(cuts[:-1], cuts[1:],
                                                                                         strict=False)))
    one_line, lines = _build_growth(single, tmp_path / "tok"), _build_growth(short, tmp_path / "tok")
    assert one_line["tokens"] > 500_000
    # Tokenized in one call, this line grew RSS by 640 MB (short lines: ~65 MB); with 1M-character pieces by
    # 170 MB; with the 128k-character pieces about as much as the short lines.
    assert one_line["growth_kib"] < 1.25 * lines["growth_kib"] + 32 * 1024, (one_line, lines)
