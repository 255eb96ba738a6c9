"""Row templates: how a raw row of a question-answering or multiple-choice dataset becomes a prompt and an answer
(`dataset.template`), in the layouts NeMo AutoModel's dataset builders use, so that a recipe written for them trains
on the same text:

- ``squad`` (SQuAD rows: ``context``, ``question``, ``answers.text``): ``Context: {context} Question: {question}
  Answer: `` and the first answer, stripped;
- ``hellaswag`` (``ctx``, ``endings``, ``label``): the context and the labelled ending, joined as they are;
- ``columns`` (``column_mapping`` names the columns of the roles ``context``, ``question``, ``answer``): the context
  and the question joined by a space, and the answer.

The loss is on the answer only. With a chat template (the tokenizer's, unless ``use_chat_template: false``) the row is
a conversation instead: ``squad`` one user turn with the prompt and the assistant's answer; ``columns`` a system turn
with the context, a user turn with the question, the assistant's answer (``hellaswag`` is never a chat, as in NeMo).

# NOTE [ The prompt's trailing space belongs to the answer ]
# The templates end the prompt with a space ("... Answer: "). remat tokenizes prompt and answer apart (the loss mask
# is exact at their boundary); a prompt ending in a space would make the space a token of its own and the answer's
# first word a word without its leading space, which is not how the joined text tokenizes. So the prompt's trailing
# whitespace moves to the front of the answer: the strings joined are the template's, the first answer word
# tokenizes as in the joined text, and it is a target.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from remat.data.config import DatasetConfig
from remat.data.sources import RawRow
from remat.errors import ConfigError

PROMPT, COMPLETION, MESSAGES = "prompt", "completion", "messages"


def apply_template(rows: Iterator[RawRow], cfg: DatasetConfig, *, chat: bool,
                   key_prefix: str = "dataset") -> tuple[Iterator[RawRow], str]:
    """``rows`` as the prompt/completion (or, with ``chat``, messages) rows of ``cfg.template``, and that format."""
    assert cfg.template is not None
    template = cfg.template
    chat = chat and template != "hellaswag"
    make: Callable[[Mapping[str, Any], str], dict[str, Any]]
    if template == "squad":
        make = _squad_chat if chat else _squad
    elif template == "hellaswag":
        make = _hellaswag
    else:
        mapping = dict(cfg.column_mapping or {})

        def make(data: Mapping[str, Any], where: str) -> dict[str, Any]:
            return _columns(data, where, mapping, chat)

    def mapped() -> Iterator[RawRow]:
        for row in rows:
            try:
                yield RawRow(make(row.data, row.where), row.where)
            except (KeyError, IndexError, TypeError, ValueError) as err:
                raise ConfigError(f"{key_prefix}.template: {row.where} does not have the {template!r} layout "
                                  f"({_why(err)}; keys: {sorted(row.data)}); {_LAYOUTS[template]}") from None

    return mapped(), MESSAGES if chat else "prompt_completion"


_LAYOUTS: dict[str, str] = {
    "squad": "allowed: rows with 'context', 'question' and 'answers' {'text': [...]} (SQuAD's)",
    "hellaswag": "allowed: rows with 'ctx', 'endings' (a list) and 'label' (an index into it) (HellaSwag's)",
    "columns": "allowed: rows with the string columns column_mapping names",
}


def _why(err: Exception) -> str:
    if isinstance(err, KeyError):
        return f"no field {err.args[0]!r}"
    return f"{type(err).__name__}: {err}"


def _prompt_and_answer(prompt: str, answer: str) -> dict[str, str]:
    """NOTE [ The prompt's trailing space belongs to the answer ]."""
    kept = prompt.rstrip()
    return {PROMPT: kept, COMPLETION: prompt[len(kept):] + answer}


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} is {type(value).__name__}, not text")
    return value


def _squad_answer(data: Mapping[str, Any]) -> str:
    texts = data["answers"]["text"]
    return _text(texts[0], "answers.text[0]").strip() if texts else ""


def _squad(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    prompt = f"Context: {_text(data['context'], 'context')} Question: {_text(data['question'], 'question')} Answer: "
    return _prompt_and_answer(prompt, _squad_answer(data))


def _squad_chat(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    context, question = data.get("context") or "", data.get("question") or ""
    prompt = f"Context: {_text(context, 'context')} Question: {_text(question, 'question')} Answer: "
    return {MESSAGES: [{"role": "user", "content": prompt},
                       {"role": "assistant", "content": _squad_answer(data)}]}


def _hellaswag(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    endings = data["endings"]
    if not isinstance(endings, list):
        raise TypeError(f"endings is {type(endings).__name__}, not a list")
    label = int(data["label"])
    if not 0 <= label < len(endings):
        raise IndexError(f"label {label} is not an index into {len(endings)} endings")
    return {PROMPT: _text(data["ctx"], "ctx"), COMPLETION: _text(endings[label], f"endings[{label}]")}


def _columns(data: Mapping[str, Any], where: str, mapping: dict[str, str], chat: bool) -> dict[str, Any]:
    role = {name: _text(data[column], column) if data[column] is not None else None
            for name, column in mapping.items()}
    context, question, answer = role.get("context"), role.get("question"), role["answer"]
    if answer is None:
        raise TypeError(f"{mapping['answer']} (the answer) is null")
    if chat:
        return {MESSAGES: [{"role": "system", "content": context or ""}, {"role": "user", "content": question or ""},
                           {"role": "assistant", "content": answer}]}
    return _prompt_and_answer(" ".join(part for part in (context, question, "") if part is not None), answer)
