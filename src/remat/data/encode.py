"""Token ids of many texts in bounded memory: short texts are batch-encoded a group at a time, long ones in pieces.

While a fast tokenizer encodes one text it holds about 200 bytes per character of that text (its normalized string
with per-byte alignments, the pre-tokenized splits), and its output holds, per token, a Python int, offsets and the
token's string: a 20 MB text tokenized in one call cost 3 GB. So texts are encoded in groups of at most `GROUP_CHARS`
characters (and `GROUP_TEXTS` texts; a batch call frees each text's intermediates as it goes), and a text longer
than `PIECE_CHARS` (128k characters, ~25 MB while it is encoded) is cut into pieces of at most that many characters,
each tokenized on its own; every result becomes an int32 numpy array at once.

Where a long text is cut: just before a space that follows a non-space character (the start of a run of spaces), the
last such place in the piece's window. Byte-level BPE tokenizers with GPT-2 style pre-tokenization (GPT-2, Llama 3,
Qwen, Mistral's tekken, the builtin tokenizer) never merge across that place: a word starts with its leading space,
and a run of spaces is split from the word after it the same way whatever precedes it. So the ids equal those of the
uncut text. Tokenizers that normalize or pre-tokenize by context across a cut (SentencePiece with a prefix space
added to each call, a normalizer that strips whitespace) may differ in the token or two at each cut. A window with no
such space in it (128k characters without a space) is cut at its end, which may split a token there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from transformers import PreTrainedTokenizerBase

from remat.errors import ConfigError

PIECE_CHARS: Final[int] = 1 << 17
"""The most characters tokenized in one call for a single long text."""
GROUP_CHARS: Final[int] = 1 << 20
"""The most characters of short texts batch-encoded in one call."""
GROUP_TEXTS: Final[int] = 1024
"""The most texts batch-encoded in one call."""


@dataclass
class EncodedText:
    """The ids of one text (int32) and, when asked for, the character offset where each token starts (int64)."""

    ids: np.ndarray
    starts: np.ndarray | None = None


def cut_points(text: str, piece_chars: int = PIECE_CHARS) -> list[int]:
    """Where `text` is cut into pieces of at most `piece_chars` characters (see the module docstring): the start of
    every piece after the first, in order (empty when the text fits one piece)."""
    cuts: list[int] = []
    start = 0
    while len(text) - start > piece_chars:
        end = start + piece_chars
        cut = text.rfind(" ", start + 1, end + 1)
        while cut > start and text[cut - 1].isspace():
            cut = text.rfind(" ", start + 1, cut)
        cut = cut if cut > start else end
        cuts.append(cut)
        start = cut
    return cuts


def _pieces(text: str, piece_chars: int) -> Iterator[tuple[int, str]]:
    bounds = [0, *cut_points(text, piece_chars), len(text)]
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=False):
        yield lo, text[lo:hi]


def _batch(tokenizer: PreTrainedTokenizerBase, texts: list[str], offsets: bool) -> list[EncodedText]:
    try:
        encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=offsets)
    except Exception as err:  # the tokenizers library raises a bare Exception (e.g. no unknown token for a word)
        if isinstance(err, (ConfigError, MemoryError, KeyboardInterrupt)):
            raise
        raise ConfigError(f"tokenizer: cannot encode the data ({' '.join(str(err).split())[:200]}); allowed: a "
                          "tokenizer that encodes any text (a vocabulary with an unknown token, or byte-level)"
                          ) from None
    ids = encoded["input_ids"]
    spans = encoded["offset_mapping"] if offsets else [None] * len(ids)
    out = []
    for row_ids, row_spans in zip(ids, spans, strict=True):
        starts = None if row_spans is None else np.fromiter((s for s, _ in row_spans), np.int64, len(row_spans))
        out.append(EncodedText(np.asarray(row_ids, dtype=np.int32), starts))
    return out


def _long(tokenizer: PreTrainedTokenizerBase, text: str, offsets: bool, piece_chars: int) -> EncodedText:
    ids: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    for lo, piece in _pieces(text, piece_chars):
        (part,) = _batch(tokenizer, [piece], offsets)
        ids.append(part.ids)
        if part.starts is not None:
            starts.append(part.starts + lo)
    return EncodedText(np.concatenate(ids), np.concatenate(starts) if offsets else None)


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], *, offsets: bool = False,
                 piece_chars: int | None = None) -> list[EncodedText]:
    """The ids of each of `texts` (no special tokens added), with token start offsets when `offsets` (a fast
    tokenizer is needed for those); memory stays bounded by the group and piece sizes (see the module docstring;
    `piece_chars` None: `PIECE_CHARS`)."""
    piece_chars = PIECE_CHARS if piece_chars is None else piece_chars
    out: list[EncodedText] = []
    group: list[str] = []
    group_chars = 0

    def flush() -> None:
        nonlocal group_chars
        if group:
            out.extend(_batch(tokenizer, group, offsets))
            group.clear()
            group_chars = 0

    for text in texts:
        if len(text) > piece_chars:
            flush()
            out.append(_long(tokenizer, text, offsets, piece_chars))
            continue
        if group_chars + len(text) > GROUP_CHARS or len(group) >= GROUP_TEXTS:
            flush()
        group.append(text)
        group_chars += len(text)
    flush()
    return out
