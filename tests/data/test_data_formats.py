"""build_dataset on JSONL rows of each format: detection, masking, chat templates."""

from __future__ import annotations

import itertools

import pytest
import torch

from remat.data import IGNORE_INDEX, DatasetConfig, build_dataset
from remat.errors import ConfigError

X = IGNORE_INDEX


def test_text_rows_are_packed_with_bos_eos_and_positions(word_tok, wid, write_jsonl) -> None:
    path = write_jsonl([{"text": "a b c"}, {"text": "d e"}, {"text": "f"}])
    ds = build_dataset(DatasetConfig(path=str(path), seq_length=4, shuffle=False), word_tok)
    assert ds.format == "text" and ds.packed and len(ds) == 3
    # <bos> a b c <eos> | <bos> d e <eos> | <bos> f <eos>  -> 12 tokens, 3 rows of 4
    assert ds.tensors["input_ids"].tolist() == [
        [0] + wid("a b c"),
        [1, 0] + wid("d e"),
        [1, 0, wid("f")[0], 1],
    ]
    assert ds.tensors["position_ids"].tolist() == [[0, 1, 2, 3], [0, 0, 1, 2], [0, 0, 1, 2]]
    assert ds.tensors["labels"].tolist() == [
        [X] + wid("a b c"),
        [1, X] + wid("d e"),
        [1, X, wid("f")[0], 1],
    ]
    assert set(ds[0]) == {"input_ids", "labels", "position_ids"}
    assert ds.num_label_tokens == 7  # labels at position 0 are never predicted


def test_prompt_completion_masks_the_prompt(word_tok, wid, write_jsonl) -> None:
    path = write_jsonl([{"prompt": "a b", "completion": "c d"}, {"prompt": "e", "completion": "f"}])
    ds = build_dataset(DatasetConfig(path=str(path), seq_length=6, packing=False), word_tok)
    assert ds.format == "prompt_completion"
    assert ds.tensors["input_ids"].tolist() == [[0] + wid("a b c d") + [1], [0] + wid("e f") + [1, 2, 2]]
    assert ds.tensors["labels"].tolist() == [[X, X, X] + wid("c d") + [1], [X, X] + wid("f") + [1, X, X]]
    assert ds.tensors["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]


def test_custom_field_names_and_explicit_format(word_tok, wid, write_jsonl) -> None:
    path = write_jsonl([{"q": "a", "ans": "b c", "text": "ignored"}])
    cfg = DatasetConfig(
        path=str(path),
        format="prompt_completion",
        prompt_field="q",
        completion_field="ans",
        seq_length=5,
        packing=False,
    )
    ds = build_dataset(cfg, word_tok)
    assert ds.tensors["labels"].tolist() == [[X, X] + wid("b c") + [1]]


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"text": "a", "meta": 1}, "text"),
        ({"prompt": "a", "completion": "b", "text": "c"}, "prompt_completion"),
        ({"messages": [{"role": "assistant", "content": "a"}], "text": "b"}, "messages"),
    ],
)
def test_auto_detects_format_from_first_row(builtin_tok, write_jsonl, row, expected) -> None:
    path = write_jsonl([row] * 4)
    ds = build_dataset(DatasetConfig(path=str(path), seq_length=4, packing=False), builtin_tok)
    assert ds.format == expected


def test_messages_train_only_on_assistant_turns(builtin_tok, write_jsonl) -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is an assert statement?"},
        {"role": "assistant", "content": "A debugging check."},
        {"role": "user", "content": "And pass?"},
        {"role": "assistant", "content": "A statement that does nothing."},
    ]
    path = write_jsonl([{"messages": conversation}])
    ds = build_dataset(DatasetConfig(path=str(path), seq_length=128, packing=False), builtin_tok)
    row = ds[0]
    n = int(row["attention_mask"].sum())
    ids, labels = row["input_ids"][:n], row["labels"][:n]
    rendered = builtin_tok.apply_chat_template(conversation, tokenize=False)
    assert builtin_tok.decode(ids) == rendered  # BOS/EOS come from the template, nothing added twice
    assert ids[0].item() == builtin_tok.bos_token_id and ids[-1].item() == builtin_tok.eos_token_id
    # The targets are exactly the two assistant contents, each followed by the end-of-turn token.
    target = labels != X
    trained = [
        builtin_tok.decode([int(ids[i]) for i, _ in group])
        for is_target, group in itertools.groupby(enumerate(target.tolist()), key=lambda item: item[1])
        if is_target
    ]
    assert trained == ["A debugging check.<|eos|>", "A statement that does nothing.<|eos|>"]
    assert torch.equal(labels[target], ids[target])


def test_a_datasets_own_chat_template_renders_its_conversations(builtin_tok, write_jsonl, tmp_path) -> None:
    """``dataset.chat_template``: a template file (NeMo's builders take one) renders this dataset's rows in place of
    the tokenizer's; the recipe's tokenizer keeps its own; a missing or empty file is one line naming the key."""
    conversation = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello again"}]
    path = write_jsonl([{"messages": conversation}])
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}", encoding="utf-8")
    own = builtin_tok.chat_template
    ds = build_dataset(DatasetConfig(path=str(path), seq_length=64, packing=False, chat_template=str(template)),
                       builtin_tok)
    row = ds[0]
    n = int(row["attention_mask"].sum())
    ids, labels = row["input_ids"][:n], row["labels"][:n]
    # (transformers renders with trim_blocks: the newline after a block tag goes; the tokenizer adds its BOS)
    assert builtin_tok.decode(ids).endswith("[user] Hi there[assistant] Hello again<|eos|>")
    trained = builtin_tok.decode(ids[labels != X])  # the assistant turn (a token glued across its start is not)
    assert trained.endswith("llo again<|eos|>") and "Hi" not in trained and "[" not in trained
    assert builtin_tok.chat_template == own
    for text, message in (("", ": '.*' is empty"), (None, " '.*' cannot be read")):
        missing = tmp_path / "none.jinja"
        if text is not None:
            missing.write_text(text)
        with pytest.raises(ConfigError, match=rf"^dataset.chat_template{message}"):
            build_dataset(DatasetConfig(path=str(path), chat_template=str(missing)), builtin_tok)
        missing.unlink(missing_ok=True)


def test_messages_need_a_chat_template(word_tok, write_jsonl) -> None:
    path = write_jsonl([{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(Exception, match=r"dataset\.format: 'messages' needs a tokenizer with a chat template"):
        build_dataset(DatasetConfig(path=str(path)), word_tok)


def test_directory_and_list_of_files_are_read_in_order(word_tok, wid, write_jsonl, tmp_path) -> None:
    write_jsonl([{"text": "b"}], "dir/2.jsonl")
    write_jsonl([{"text": "a"}], "dir/1.jsonl")
    (tmp_path / "dir" / "notes.txt").write_text("not data")
    from_dir = build_dataset(DatasetConfig(path=str(tmp_path / "dir"), seq_length=3, packing=False), word_tok)
    listed = build_dataset(
        DatasetConfig(path=[str(tmp_path / "dir/2.jsonl"), str(tmp_path / "dir/1.jsonl")], seq_length=3, packing=False),
        word_tok,
    )
    assert from_dir.tensors["input_ids"][:, 1].tolist() == wid("a b")
    assert listed.tensors["input_ids"][:, 1].tolist() == wid("b a")


def test_max_samples_keeps_the_first_rows_and_skips_later_bad_ones(word_tok, wid, write_jsonl) -> None:
    path = write_jsonl([{"text": "a"}, {"text": "b"}, "{broken"])
    ds = build_dataset(DatasetConfig(path=str(path), seq_length=3, packing=False, max_samples=2), word_tok)
    assert ds.tensors["input_ids"][:, 1].tolist() == wid("a b")


def test_rows_without_targets_are_dropped(word_tok, wid, write_jsonl) -> None:
    path = write_jsonl([{"prompt": "a b c d", "completion": "e"}, {"prompt": "f", "completion": "g"}])
    ds = build_dataset(DatasetConfig(path=str(path), seq_length=4, packing=False), word_tok)
    assert len(ds) == 1
    assert ds.tensors["input_ids"].tolist() == [[0] + wid("f g") + [1]]
