"""Every user mistake the data pipeline can meet is a ConfigError naming the key, the place and what is allowed."""

from __future__ import annotations

import re

import pytest

from remat.data import DatasetConfig, build_dataset
from remat.errors import ConfigError


def expect_error(pattern: str, cfg: DatasetConfig, tokenizer, **kwargs) -> None:
    with pytest.raises(ConfigError, match=pattern):
        build_dataset(cfg, tokenizer, **kwargs)


def test_invalid_json_names_file_and_line(word_tok, write_jsonl) -> None:
    path = write_jsonl([{"text": "a"}, "", '{"text": "b",}'])
    expect_error(
        rf"^dataset\.path: {re.escape(str(path))} line 3 is not valid JSON", DatasetConfig(path=str(path)), word_tok
    )


def test_non_utf8_line_names_file_line_and_byte(word_tok, tmp_path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    expect_error(rf"^dataset\.path: {re.escape(str(path))} line 2 is not UTF-8 text \(byte 0xe9 at column 14\)",
                 DatasetConfig(path=str(path)), word_tok)


def test_non_object_row_names_line_and_type(word_tok, write_jsonl) -> None:
    path = write_jsonl([{"text": "a"}, "[1, 2]"])
    expect_error(r"line 2 must be a JSON object, got list", DatasetConfig(path=str(path)), word_tok)


def test_missing_field_names_line_keys_and_expected_fields(word_tok, write_jsonl) -> None:
    path = write_jsonl([{"prompt": "a", "completion": "b"}, {"prompt": "c", "answer": "d"}])
    expect_error(
        r"line 2 has no field 'completion' \(keys: \['answer', 'prompt'\]\); "
        r"format 'prompt_completion' expects 'prompt' and 'completion'",
        DatasetConfig(path=str(path)),
        word_tok,
    )


def test_wrong_field_type_is_named(word_tok, write_jsonl) -> None:
    path = write_jsonl([{"text": 3}])
    expect_error(
        r"line 1 field 'text' must be a string for format 'text', got int", DatasetConfig(path=str(path)), word_tok
    )


def test_undetectable_format_lists_every_format(word_tok, write_jsonl) -> None:
    path = write_jsonl([{"body": "a"}])
    expect_error(
        r"^dataset\.format: cannot detect the format of .*line 1 \(keys: \['body'\]\); expected 'messages' for "
        r"messages; 'prompt' and 'completion' for prompt_completion; 'text' for text",
        DatasetConfig(path=str(path)),
        word_tok,
    )


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ("hello", "got str"),
        ([], "got an empty list"),
        (["hi"], "message 0 is a str"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], r"message 1 has keys \['role'\]"),
    ],
)
def test_malformed_messages_are_named(builtin_tok, write_jsonl, messages, problem) -> None:
    path = write_jsonl([{"messages": messages}])
    expect_error(
        rf"line 1 field 'messages' must be a non-empty list of \{{'role': str, 'content': str\}} objects; {problem}",
        DatasetConfig(path=str(path)),
        builtin_tok,
    )


def test_chat_template_that_is_not_turn_by_turn_is_refused(builtin_tok, write_jsonl) -> None:
    tok = builtin_tok.__class__.from_pretrained(builtin_tok.name_or_path, local_files_only=True)
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = write_jsonl([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}])
    expect_error(
        r"line 1: the tokenizer's chat template does not render this conversation turn by turn",
        DatasetConfig(path=str(path)),
        tok,
    )


def test_missing_path_uses_the_given_key_prefix(word_tok, tmp_path) -> None:
    missing = str(tmp_path / "nope.jsonl")
    expect_error(
        rf"^validation_dataset\.path: '{re.escape(missing)}' does not exist; expected a \.jsonl file",
        DatasetConfig(path=missing),
        word_tok,
        key_prefix="validation_dataset",
    )


def test_list_entries_are_named_by_index(word_tok, write_jsonl, tmp_path) -> None:
    good = write_jsonl([{"text": "a"}])
    expect_error(
        r"^dataset\.path\[1\]: .* does not exist", DatasetConfig(path=[str(good), str(tmp_path / "x.jsonl")]), word_tok
    )


def test_directory_without_jsonl_and_wrong_suffix(word_tok, tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    expect_error(r"directory .*empty has no \.jsonl files", DatasetConfig(path=str(tmp_path / "empty")), word_tok)
    (tmp_path / "data.csv").write_text("text\na\n")
    expect_error(r"'.*data\.csv' is not a \.jsonl file", DatasetConfig(path=str(tmp_path / "data.csv")), word_tok)


def test_empty_file_has_no_rows(word_tok, tmp_path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    expect_error(
        r"^dataset\.path: '.*empty\.jsonl' holds no rows", DatasetConfig(path=str(tmp_path / "empty.jsonl")), word_tok
    )


def test_split_on_jsonl_is_refused(word_tok, write_jsonl) -> None:
    path = write_jsonl([{"text": "a"}])
    expect_error(
        r"^dataset\.split: .* is JSONL, which has no splits; got split 'train'",
        DatasetConfig(path=str(path), split="train"),
        word_tok,
    )


def test_builtin_corpus_is_text_only_and_has_two_splits(word_tok) -> None:
    expect_error(
        r"^dataset\.format: the builtin corpus .* is plain text; got 'messages'",
        DatasetConfig(format="messages"),
        word_tok,
    )
    expect_error(
        r"^dataset\.split: the builtin corpus has splits \['train', 'validation'\]; got 'test'",
        DatasetConfig(split="test"),
        word_tok,
    )


def test_too_few_tokens_for_one_packed_row(word_tok, write_jsonl) -> None:
    path = write_jsonl([{"text": "a b"}])
    expect_error(
        r"^dataset\.seq_length: the data holds 4 tokens, fewer than one packed row of 8",
        DatasetConfig(path=str(path), seq_length=8),
        word_tok,
    )


def test_data_without_any_target_is_refused(word_tok, write_jsonl) -> None:
    path = write_jsonl([{"prompt": "a b c", "completion": ""}])
    expect_error(r"^dataset: no row has a loss target", DatasetConfig(path=str(path), seq_length=4), word_tok)
