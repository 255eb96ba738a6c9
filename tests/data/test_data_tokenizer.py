"""Tokenizers: the builtin byte-level BPE and its cache, loading from paths, the model-directory default."""

from __future__ import annotations

import logging

import pytest

from remat.data import TokenizerConfig, build_tokenizer
from remat.data import tokenizer as tokenizer_module
from remat.data.tokenizer import builtin_tokenizer_fingerprint
from remat.errors import ConfigError


def test_builtin_has_special_tokens_and_a_chat_template(builtin_tok) -> None:
    assert len(builtin_tok) == 4096
    assert builtin_tok.convert_ids_to_tokens(
        [builtin_tok.bos_token_id, builtin_tok.eos_token_id, builtin_tok.pad_token_id]
    ) == [
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
    ]
    rendered = builtin_tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        tokenize=False,
        add_generation_prompt=False,
    )
    assert rendered == "<|bos|><|user|>\nHi<|eos|><|assistant|>\nHello<|eos|>"
    assert builtin_tok.convert_tokens_to_ids("<|assistant|>") == 5


def test_builtin_round_trips_any_text(builtin_tok) -> None:
    text = "The assert statement: naïve café, 東京, 🙂\n\ttabs"
    ids = builtin_tok(text, add_special_tokens=False)["input_ids"]
    assert builtin_tok.decode(ids) == text
    assert builtin_tok.unk_token_id is None  # byte-level: nothing is unknown
    # Trained on real English text, so common words are single tokens.
    assert len(builtin_tok(" statement", add_special_tokens=False)["input_ids"]) == 1


def test_cache_is_reused_without_retraining(_isolated_cache, monkeypatch) -> None:
    calls = []
    real_train = tokenizer_module.train_byte_level_bpe
    monkeypatch.setattr(
        tokenizer_module, "train_byte_level_bpe", lambda *a, **k: calls.append(a) or real_train(*a, **k)
    )
    first = build_tokenizer(TokenizerConfig(vocab_size=600))
    second = build_tokenizer(TokenizerConfig(vocab_size=600))
    assert len(calls) == 1
    assert second("print('x')")["input_ids"] == first("print('x')")["input_ids"]
    entries = sorted(p.name for p in (_isolated_cache / "tokenizers").iterdir())
    assert entries == [builtin_tokenizer_fingerprint(600)]  # no temporary directory left behind
    build_tokenizer(TokenizerConfig(vocab_size=700))
    assert len(calls) == 2  # other settings, other cache entry


def test_concurrent_writer_keeps_the_first_result(_isolated_cache) -> None:
    tok = build_tokenizer(TokenizerConfig(vocab_size=600))
    target = _isolated_cache / "tokenizers" / builtin_tokenizer_fingerprint(600)
    tokenizer_module._save_atomically(tok, target)  # a second writer losing the race must not fail
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_vocab_larger_than_the_corpus_supports_is_reported(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="remat.data.tokenizer"):
        tok = build_tokenizer(TokenizerConfig(vocab_size=65536))
    assert len(tok) < 65536
    assert f"the builtin tokenizer has {len(tok)} entries" in caplog.text


def test_load_from_directory_file_and_model_directory(word_tok, tmp_path) -> None:
    word_tok.save_pretrained(str(tmp_path / "tok"))
    expected = word_tok("a b z")["input_ids"]
    from_dir = build_tokenizer(TokenizerConfig(path=str(tmp_path / "tok")))
    from_file = build_tokenizer(TokenizerConfig(path=str(tmp_path / "tok" / "tokenizer.json")))
    from_model = build_tokenizer(TokenizerConfig(), model_path=str(tmp_path / "tok"))
    assert (
        from_dir("a b z")["input_ids"]
        == from_file("a b z")["input_ids"]
        == from_model("a b z")["input_ids"]
        == expected
    )
    assert from_dir.eos_token == from_model.eos_token == "<eos>"


def test_model_directory_without_tokenizer_falls_back_to_builtin(tmp_path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    tok = build_tokenizer(TokenizerConfig(vocab_size=600), model_path=str(tmp_path / "model"))
    assert len(tok) == 600 and tok.bos_token == "<|bos|>"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", r"^tokenizer\.path: '.*missing' does not exist; expected a local directory"),
        (lambda p: p, r"^tokenizer\.path: directory '.*' holds no tokenizer files"),
        (lambda p: (p / "vocab.txt").write_text("a") and p / "vocab.txt", r"is a file but not a tokenizer \.json file"),
        (
            lambda p: (p / "tokenizer.json").write_text("{}") and p / "tokenizer.json",
            r"cannot load '.*tokenizer\.json'",
        ),
    ],
)
def test_bad_tokenizer_paths(tmp_path, make, message) -> None:
    with pytest.raises(ConfigError, match=message):
        build_tokenizer(TokenizerConfig(path=str(make(tmp_path))))


def test_a_tokenizer_directory_s_own_code_never_runs_and_nothing_asks_on_stdin(tmp_path, builtin_tok,
                                                                               monkeypatch) -> None:
    """NOTE [ No prompt, no tokenizer code ]: a directory whose tokenizer_config.json names a class of its own
    Python file; stdin answers "y" as a pipe would. The load is refused in one line and the file never runs."""
    import io
    import json

    from remat.data.tokenizer import load_tokenizer_from_path

    directory = tmp_path / "tok"
    builtin_tok.save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["tok_evil.EvilTokenizer", None]})
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (directory / "tok_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                           "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("y\ny\n"))
    for load in (lambda: load_tokenizer_from_path(str(directory)),
                 lambda: build_tokenizer(TokenizerConfig(), model_path=str(directory))):
        with pytest.raises(ConfigError, match=r"(tokenizer.path|model.pretrained_model_name_or_path): the tokenizer in "
                                              r".* names Python code of its own .*allowed: .*--trust-remote-code"
                           ) as refused:
            load()
        assert "\n" not in str(refused.value)
    assert not marker.exists()


def test_an_oversized_tokenizer_file_is_refused_before_it_is_parsed(tmp_path, builtin_tok, monkeypatch) -> None:
    """A 300 MB token grew a process to 9.9 GB in the tokenizers library: the file's size is checked first."""
    from remat.data.tokenizer import load_tokenizer_from_path

    builtin_tok.save_pretrained(tmp_path / "tok")
    size = (tmp_path / "tok" / "tokenizer.json").stat().st_size
    monkeypatch.setattr(tokenizer_module, "TOKENIZER_FILE_LIMIT", size - 1)
    for path in (tmp_path / "tok", tmp_path / "tok" / "tokenizer.json"):
        with pytest.raises(ConfigError, match=rf"^tokenizer.path: .*tokenizer.json holds {size:,} bytes; allowed: at "
                                              rf"most {size - 1:,}"):
            load_tokenizer_from_path(str(path))


def test_a_tokenizer_without_an_unknown_token_is_one_line_at_the_first_word_it_cannot_encode(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from remat.data import DatasetConfig, build_dataset
    from remat.data.tokenizer import load_tokenizer_from_path

    words = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "<eos>": 2}))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "rows.jsonl").write_text('{"text": "a b zzz"}\n')
    tokenizer = load_tokenizer_from_path(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"^tokenizer: cannot encode the data \(WordLevel error: Missing \[UNK\] "
                                          r"token from the vocabulary\); allowed: a tokenizer that encodes any text"):
        build_dataset(DatasetConfig(path=str(tmp_path / "rows.jsonl"), seq_length=8, packing=False), tokenizer)
