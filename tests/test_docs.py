"""What the README and the examples say matches what the code does: the sample log line is a line the run prints, and
every docs section an example points to exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from remat.recipes.reports.reporting import GIB, StepRecord

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"step (\d+) \| epoch (\d+) \| loss ([\d.]+) \| grad_norm ([\d.]+) \| lr ([\d.e+-]+) \| "
                  r"mem ([\d.]+) GiB \| tps (\d+) \| num_label_tokens (\d+)")


def test_the_readme_sample_line_is_a_line_the_run_prints() -> None:
    readme = (ROOT / "README.md").read_text()
    match = LINE.search(readme)
    assert match is not None, "README shows no step line"
    step, epoch, loss, norm, lr, mem, tps, tokens = match.groups()
    record = StepRecord(step=int(step), epoch=int(epoch), loss=float(loss), grad_norm=float(norm), lr=float(lr),
                        mem_bytes=round(float(mem) * GIB), mem_source="tracked", tps=float(tps),
                        num_label_tokens=int(tokens), step_time_s=1.0)
    assert record.line() == match.group(0)
    quickstart = (ROOT / "examples" / "quickstart.yaml").read_text()
    seq_length = int(re.search(r"seq_length:\s*(\d+)", quickstart).group(1))  # type: ignore[union-attr]
    batch = int(re.search(r"global_batch_size:\s*(\d+)", quickstart).group(1))  # type: ignore[union-attr]
    assert int(tokens) <= seq_length * batch  # a figure the quick start can produce


def test_every_docs_section_an_example_points_to_exists() -> None:
    pointers = 0
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        text = " ".join(line.lstrip("# ") for line in example.read_text().splitlines())
        for doc, section in re.findall(r"(docs/[\w-]+\.md), \"([^\"]+)\"", text):
            headings = re.findall(r"^#+ (.+)$", (ROOT / doc).read_text(), flags=re.M)
            assert section in headings, f"{example.name} points to {doc} section {section!r}, which does not exist"
            pointers += 1
    assert pointers >= 1


def test_every_command_is_listed_in_the_readme_and_the_architecture_page() -> None:
    from remat.cli import COMMANDS

    readme = (ROOT / "README.md").read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `remat (\w+)", readme, flags=re.M)
    assert listed == list(COMMANDS)
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    assert f"`remat {' | '.join(COMMANDS)}`" in architecture


def _python_blocks(path: Path) -> list[str]:
    text = path.read_text()
    return [part.split("```", 1)[0] for part in text.split("```python\n")[1:]]


DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
BLOCKS = [(path.relative_to(ROOT).as_posix(), index) for path in DOCS for index in range(len(_python_blocks(path)))]

_TINY = ("import torch\nimport remat\ntorch.manual_seed(0)\n"
         "model = remat.build_model(remat.ModelConfig(preset='tiny-llama'), vocab_size=512)\n"
         "ids = torch.randint(0, 512, (2, 64)); input_ids = ids; mask = torch.ones_like(ids); labels = ids.clone()\n"
         "n = int(labels[:, 1:].ne(-100).sum())\n"
         "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)\n")
#: What a block that is a fragment of the user's own code runs after: the objects its text names (a model, a batch),
#: kept out of the docs so that they read as the user's code.
CONTEXT: dict[tuple[str, int], str] = {
    ("docs/checkpointing.md", 0): _TINY,
    ("docs/data.md", 0): "import json\nwith open('train.jsonl', 'w') as f:\n"
                         "    f.writelines(json.dumps({'text': 'a b c d e f g h ' * 40}) + '\\n' for _ in range(32))\n",
    ("docs/loss.md", 0): "import torch\nlogits = torch.randn(2, 16, 64); labels = torch.randint(0, 64, (2, 16))\n"
                         "hidden_states = torch.randn(2, 16, 8); lm_head_weight = torch.randn(64, 8)\n",
    ("docs/loss.md", 1): _TINY,
    ("docs/memory.md", 0): _TINY,
    ("docs/memory.md", 1): _TINY + "batches = [{'input_ids': ids, 'labels': ids}] * 2\n",
    ("docs/models.md", 2): _TINY + "from remat.data import StatefulBatchIterator, build_tokenizer, TokenizerConfig\n"
                           "step, epoch = 3, 0\n"
                           "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)\n"
                           "tokenizer = build_tokenizer(TokenizerConfig(vocab_size=512))\n"
                           "batches = StatefulBatchIterator([{'input_ids': ids[0], 'labels': ids[0]}] * 4, batch_size=2)\n",
    ("docs/models.md", 3): "from tiny import tiny_causal_lm\ntiny_causal_lm().save_pretrained('my-model')\n",
    ("docs/planner.md", 0): _TINY,
    ("README.md", 1): "from test_docs import tiny_trainer\nimport remat\ntrainer = tiny_trainer()\n",
}
#: Blocks not run here, and why (each is run where its reason allows: the tests named).
NOT_RUN: dict[tuple[str, int], str] = {
    ("README.md", 0): "downloads Llama-3.2-1B from the Hub and runs under torchrun (the same call on a preset: "
                      "tests/distributed/test_auto_model.py)",
    ("docs/models.md", 0): "downloads Llama-3.2-1B from the Hub (from_pretrained on a cached Hub id: "
                           "tests/models/test_models_hub.py)",
    ("docs/data.md", 1): "a signature, not a statement",
    ("docs/distributed.md", 0): "a train.py run under torchrun on 2 processes (tests/distributed/test_auto_model.py)",
    ("docs/distributed.md", 1): "a fragment of a training loop under torchrun (tests/distributed/test_parity.py)",
}


def tiny_trainer() -> object:
    """A Trainer of a tiny Llama on 8 rows, for the README's prepare_trainer line."""
    from tiny import tiny_causal_lm
    from transformers import Trainer, TrainingArguments

    torch = __import__("torch")
    model = tiny_causal_lm(hidden_size=32, intermediate_size=64, vocab_size=128, max_position_embeddings=16)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (8, 16))]
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=2, max_steps=1, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=rows)


def test_every_python_block_of_the_docs_is_run_or_says_why_not() -> None:
    assert set(NOT_RUN) <= set(BLOCKS) and set(CONTEXT) <= set(BLOCKS)
    assert not set(NOT_RUN) & set(CONTEXT)
    assert len(BLOCKS) >= 15


@pytest.mark.slow
@pytest.mark.parametrize(("doc", "index"), [block for block in BLOCKS if block not in NOT_RUN])
def test_docs_python_blocks_run_as_written(doc: str, index: int, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every python block of the README and docs/ runs as written, after the objects a fragment names
    (`CONTEXT`); those that need the Hub, GPUs or torchrun say so in `NOT_RUN` (#23: estimate.md once named a
    function that had moved; checkpointing.md applied five policies to one model)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    namespace: dict[str, object] = {"__name__": "__docs__"}
    exec(compile(CONTEXT.get((doc, index), ""), "<context>", "exec"), namespace)  # noqa: S102
    exec(compile(_python_blocks(ROOT / doc)[index], doc, "exec"), namespace)  # noqa: S102
