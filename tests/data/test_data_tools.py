"""Conversations with tool calls (`remat.data.templates`' ``agent_chat`` and ``xlam``, and ``messages`` rows with
``tool_calls`` and a ``tools`` field): the rows NeMo AutoModel's agent and xLAM builders read become OpenAI messages
rendered with their tool definitions, and the loss is on the assistant turns (their tool calls included), never on a
user turn, a tool's answer or the tool definitions."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tiny import tiny_word_tokenizer

from remat.data.config import AgentChatOptions, DatasetConfig
from remat.data.dataset import build_dataset
from remat.data.sources import RawRow
from remat.data.templates import apply_template
from remat.errors import ConfigError

#: A chat template that prints the tools, each turn, its tool calls and its call id (the parts a template renders).
TEMPLATE = ("{% if tools %}<tools> {% for t in tools %}{{ t.function.name }} {% endfor %}</tools> {% endif %}"
            "{% for m in messages %}<{{ m.role }}> {{ m.content }} "
            "{% for c in m.tool_calls or [] %}[ {{ c.function.name }} {{ c.function.arguments }} {{ c.id }} ] "
            "{% endfor %}{% if m.tool_call_id %}{{ m.tool_call_id }} {% endif %}</{{ m.role }}> {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")


@pytest.fixture
def tok() -> Any:
    tokenizer = tiny_word_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _converted(template: str, row: dict[str, Any], **options: Any) -> dict[str, Any]:
    cfg = DatasetConfig(path="x.jsonl", template=template, **options)
    rows, fmt = apply_template(iter([RawRow(row, "row 1")]), cfg, chat=True)
    assert fmt == "messages"
    return next(rows).data


def test_a_sharegpt_trace_becomes_openai_messages_with_numbered_calls() -> None:
    row = {"id": 7, "tools": "[]", "conversations": [
        {"from": "system", "value": "w0"}, {"from": "human", "value": "w1"},
        {"from": "function_call", "value": json.dumps({"name": "w2", "arguments": {"a": 1}})},
        {"from": "function_call", "value": json.dumps({"name": "w3", "arguments": "{}"})},
        {"from": "observation", "value": "w4"}, {"from": "observation", "value": "w5"},
        {"from": "gpt", "value": "w6"}]}
    assert _converted("agent_chat", row)["messages"] == [
        {"role": "system", "content": "w0"}, {"role": "user", "content": "w1"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_7_0", "type": "function", "function": {"name": "w2", "arguments": '{"a": 1}'}},
            {"id": "call_7_1", "type": "function", "function": {"name": "w3", "arguments": "{}"}}]},
        {"role": "tool", "content": "w4", "tool_call_id": "call_7_0"},
        {"role": "tool", "content": "w5", "tool_call_id": "call_7_1"},
        {"role": "assistant", "content": "w6"}]


def test_chatml_calls_join_the_assistant_text_before_them_and_openai_turns_keep_theirs() -> None:
    row = {"messages": [
        {"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2", "reasoning_content": "w9"},
        {"role": "tool_call", "content": json.dumps({"name": "w3", "arguments": {}})},
        {"role": "tool_response", "content": "w4", "name": "w3"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "mine", "function": {"name": "w5", "arguments": {"b": 2}}}]},
        {"role": "tool", "content": "w6", "tool_call_id": "mine"},
        {"role": "assistant", "content": "w7", "reasoning_content": "w8"}, {"role": "user", "content": "w10"}]}
    messages = _converted("agent_chat", row)["messages"]
    assert messages[1] == {"role": "assistant", "content": "w2", "reasoning_content": "w9", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "w3", "arguments": "{}"}}]}
    assert messages[2] == {"role": "tool", "content": "w4", "tool_call_id": "call_0", "name": "w3"}
    assert messages[3]["tool_calls"] == [{"id": "mine", "type": "function",
                                          "function": {"name": "w5", "arguments": '{"b": 2}'}}]
    assert len(messages) == 7
    trimmed = _converted("agent_chat", row, agent_chat=AgentChatOptions(trim_incomplete_last_turn=True,
                                                                         drop_history_reasoning_content=True))
    assert trimmed["messages"][-1] == {"role": "assistant", "content": "w7", "reasoning_content": "w8"}
    assert "reasoning_content" not in trimmed["messages"][1]


def test_an_xlam_row_is_a_query_and_one_turn_of_calls_with_json_schema_tools() -> None:
    row = {"id": 3, "query": "w1", "answers": json.dumps([{"name": "w2", "arguments": {"n": 5}}]),
           "tools": json.dumps([{"name": "w2", "description": "d", "parameters": {
               "n": {"type": "int", "description": "count"}, "unit": {"type": "str", "default": "m"}}}])}
    converted = _converted("xlam", row)
    assert converted["messages"] == [
        {"role": "user", "content": "w1"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_3_0", "type": "function", "function": {"name": "w2", "arguments": '{"n": 5}'}}]}]
    assert converted["tools"] == [{"type": "function", "function": {"name": "w2", "description": "d", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "description": "count"},
                                         "unit": {"type": "string", "description": "", "default": "m"}},
        "required": ["n"]}}}]


def test_the_loss_is_on_the_assistant_turns_and_their_calls_only(tok: Any, write_jsonl: Any) -> None:
    row = {"tools": [{"type": "function", "function": {"name": "w20", "parameters": {}}}], "messages": [
        {"role": "user", "content": "w1 w2"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w20", "arguments": "w3"}}]},
        {"role": "tool", "content": "w4 w5"}, {"role": "assistant", "content": "w6 w7"}]}
    dataset = build_dataset(DatasetConfig(path=str(write_jsonl([row])), template="agent_chat", seq_length=96,
                                          packing=False), tok)
    ids, labels = dataset[0]["input_ids"].tolist(), dataset[0]["labels"].tolist()
    words = [tok.convert_ids_to_tokens(i) for i in ids]
    targets = {tok.convert_ids_to_tokens(i) for i, label in zip(ids, labels, strict=True) if label != -100}
    assert "w20" in words[: words.index("w1")]  # the tools are rendered, before the conversation
    assert {"w20", "w3", "w6", "w7"} <= targets  # the call (name and arguments) and the answer are trained on
    assert not {"w1", "w2", "w4", "w5"} & targets  # the user's and the tool's words are not


def test_messages_rows_take_tool_calls_and_tools_without_a_template(tok: Any, write_jsonl: Any) -> None:
    row = {"tools": json.dumps([{"type": "function", "function": {"name": "w20"}}]), "messages": [
        {"role": "user", "content": "w1"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "w20", "arguments": "w3"}}]}]}
    dataset = build_dataset(DatasetConfig(path=str(write_jsonl([row])), seq_length=64, packing=False), tok)
    assert dataset.format == "messages" and "w20" in tok.convert_ids_to_tokens(dataset[0]["input_ids"].tolist())
    bad = {"messages": [{"role": "user", "content": "w1", "tool_calls": [{"function": {"name": "w2"}}]}]}
    with pytest.raises(ConfigError, match=r"message 0 has tool_calls .*; allowed on an assistant turn"):
        build_dataset(DatasetConfig(path=str(write_jsonl([bad], "bad.jsonl")), seq_length=64), tok)
    with pytest.raises(ConfigError, match=r"field 'tools' is not JSON"):
        build_dataset(DatasetConfig(path=str(write_jsonl([{**row, "tools": "[{"}], "t.jsonl")), seq_length=64), tok)


def test_tool_templates_need_a_chat_template_and_their_options_their_template(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="template: 'xlam' makes conversations with tool calls, which need a chat "
                                          "template"):
        next(apply_template(iter([]), DatasetConfig(path="x.jsonl", template="xlam"), chat=False)[0])
    with pytest.raises(ValueError, match="agent_chat: options of the agent_chat template, but template is 'squad'"):
        DatasetConfig(path="x.jsonl", template="squad", agent_chat={"trim_incomplete_last_turn": True})
    cfg = DatasetConfig(path="x.jsonl", template="agent_chat")
    rows, _ = apply_template(iter([RawRow({"messages": [{"role": "robot", "content": "w1"}]}, "row 1")]), cfg,
                             chat=True)
    with pytest.raises(ConfigError, match=r"row 1 does not have the 'agent_chat' layout \(ValueError: role 'robot'"):
        next(rows)


def _trace(*exchanges: tuple[str, str]) -> dict[str, Any]:
    messages = [{"role": "system", "content": "w0"}]
    for question, answer in exchanges:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def test_truncate_history_drops_the_oldest_exchanges_and_filter_overlong_what_still_does_not_fit(
        tok: Any, write_jsonl: Any, caplog: pytest.LogCaptureFixture) -> None:
    long = " ".join(f"w{i}" for i in range(1, 30))
    rows = [_trace(("w1", long), ("w2", long), ("w3", "w4 w5")),  # only the last exchange fits 48 tokens
            _trace(("w6", long + " " + long))]  # nothing does
    path = write_jsonl(rows)
    options = {"truncate_history": True, "filter_overlong": True}
    caplog.set_level("INFO", logger="remat.data.formats")
    dataset = build_dataset(DatasetConfig(path=str(path), template="agent_chat", agent_chat=options, seq_length=48,
                                          packing=False), tok)
    assert len(dataset) == 1
    words = [w for w in tok.convert_ids_to_tokens(dataset[0]["input_ids"].tolist()) if w.startswith("w")]
    assert words == ["w0", "w3", "w4", "w5"]  # the system turn and the last exchange
    assert "dataset: dropped 1 traces longer than seq_length 48 (agent_chat.filter_overlong)" in caplog.text
    kept = build_dataset(DatasetConfig(path=str(path), template="agent_chat", seq_length=48, packing=False), tok)
    assert len(kept) == 2  # without the options both are cut at their end


def test_a_hub_dataset_s_revision_reaches_the_datasets_library(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import huggingface_hub.constants

    from remat.data.sources import iter_rows

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no probe of the Hub: nothing is fetched
    asked: dict[str, Any] = {}

    def load_dataset(path: str, name: Any = None, **kwargs: Any) -> list[dict[str, str]]:
        asked.update(path=path, **kwargs)
        return [{"text": "w1"}]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    cfg = DatasetConfig(path="org/traces", revision="refs/convert/parquet", split="train[64:]")
    assert [row.data for row in iter_rows(cfg)] == [{"text": "w1"}]
    assert asked == {"path": "org/traces", "split": "train[64:]", "revision": "refs/convert/parquet"}
    with pytest.raises(ConfigError, match=r"^dataset.revision: 'main' is a Hub dataset's revision; .* is on the local "
                                          "disk"):
        list(iter_rows(DatasetConfig(path="./local.jsonl", revision="main")))
