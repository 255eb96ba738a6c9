"""``prepare_trainer(..., "auto")`` in TRL's SFTTrainer, predicted against measured (issue #32): the planned step is
TRL's own (its fused LM head, `remat.loss.trl_head.TRLFusedLMHead`), so each step's measured peak should stay within
the budget and the step the prediction is of (step 2, with AdamW's state) within 2% of the prediction.

On the CPU (the default) a tiny Llama (hidden 256, 4 layers, vocabulary 32768) trains rows of 256 tokens in float32
and the peak is the tracker's; ``--device cuda`` trains the Llama-3.2-1B shape (random weights, vocabulary 128256,
bf16 weights) on rows of 1024 tokens and reads the CUDA allocator's peak (the GPU path of TRL's head: Triton
kernels). Rows: ``auto`` at budgets a quarter and three quarters of the way from full's predicted peak to none's, and
the fixed policies none and full with their predictions. Writes benchmarks/results/trl_auto_<device>.{md,json}.

    .venv/bin/python benchmarks/bench_trl_auto.py
    python benchmarks/bench_trl_auto.py --device cuda          # on a GPU: bash benchmarks/gpu_acceptance.sh trl
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

GIB = 2**30
SHAPES: dict[str, dict[str, Any]] = {
    "cpu": {"config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "vocab_size": 32768}, "rows": 256, "batch": 2, "dtype": "float32"},
    "cuda": {"config": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                        "tie_word_embeddings": True, "head_dim": 64}, "rows": 1024, "batch": 4, "dtype": "bfloat16"},
}


def _trainer(device: str, out: Path, steps: int) -> Any:
    import trl
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = SHAPES[device]
    words = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(1000)}, "[UNK]": 1000, "[PAD]": 1001,
                                        "[EOS]": 1002}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]",
                                        eos_token="[EOS]")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape["config"])).to(getattr(torch, shape["dtype"]))
    texts = [" ".join(f"w{(i * 7 + j) % 1000}" for j in range(2 * shape["rows"])) for i in range(64)]
    args = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=shape["batch"], max_steps=steps,
                         logging_steps=1, report_to=[], use_cpu=device == "cpu", seed=0, save_strategy="no",
                         max_length=shape["rows"], disable_tqdm=True, bf16=False)
    return trl.SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                          processing_class=tokenizer)


def _run(device: str, policy: str, budget: int | None, steps: int) -> dict[str, Any]:
    import remat

    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(device, Path(out), steps)
        plan = remat.prepare_trainer(trainer, policy, memory_budget=budget, target=device)
        times: list[float] = []
        trainer.add_callback(_Timer(times))
        trainer.train()
        peaks = [row["peak_mem_gib"] * GIB for row in trainer.state.log_history if "peak_mem_gib" in row]
    predicted = getattr(plan, "peak_bytes", None)
    return {"policy": policy if budget is None else f"auto at {budget / GIB:.3f} GiB",
            "plan": plan.policy.describe() if hasattr(plan, "policy") else policy, "budget": budget,
            "predicted": predicted, "measured": peaks, "step_2": peaks[1] if len(peaks) > 1 else None,
            "median_s": statistics.median(times[1:]) if len(times) > 1 else None}


class _Timer(TrainerCallback):
    """Each step's wall time (the GPU synchronised at both ends)."""

    def __init__(self, times: list[float]) -> None:
        self.times, self.start = times, 0.0

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.start)


def _predicted(device: str, policy: str) -> int:
    """The planner's prediction of a fixed policy for the step this trainer runs: the planner `prepare_trainer`
    builds for ``auto`` (its private `_plan_for`, so that the step is the same one), asked for that policy."""
    from remat.checkpointing import parse_policy
    from remat.integrations import hf_trainer

    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(device, Path(out), 1)
        _, adapter = hf_trainer._plan_for(trainer, trainer.model, memory_budget=1 << 50, loss="keep",
                                          seq_length=None, target=device)
        return int(adapter.planner.estimate(parse_policy(policy)).peak_bytes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=tuple(SHAPES), default="cpu")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_trl_auto: --device cuda, and this machine has no CUDA device", file=sys.stderr)
        return 2
    full, none = _predicted(args.device, "full"), _predicted(args.device, "none")
    rows = [_run(args.device, policy, None, args.steps) for policy in ("none", "full")]
    for row, predicted in zip(rows, (none, full)):
        row["predicted"] = predicted
    rows += [_run(args.device, "auto", int(full + fraction * (none - full)), args.steps) for fraction in (0.25, 0.75)]
    import transformers
    import trl

    header = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {args.device} "
              f"({torch.cuda.get_device_name() if args.device == 'cuda' else platform.processor() or 'cpu'}); torch "
              f"{torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; "
              f"{SHAPES[args.device]}")
    lines = ["# prepare_trainer(..., 'auto') in TRL's SFTTrainer: predicted against measured", "", header, "",
             "| row | plan | predicted GiB | step 2 measured GiB | ratio | max measured GiB | within budget | "
             "median step s |", "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for row in rows:
        ratio = row["step_2"] / row["predicted"] if row["predicted"] and row["step_2"] else float("nan")
        within = "-" if row["budget"] is None else str(max(row["measured"]) <= row["budget"] * 1.0001)
        median = f"{row['median_s']:.3f}" if row["median_s"] is not None else "-"
        lines.append(f"| {row['policy']} | {row['plan']} | {row['predicted'] / GIB:.3f} | {row['step_2'] / GIB:.3f} | "
                     f"{ratio:.4f} | {max(row['measured']) / GIB:.3f} | {within} | {median} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"trl_auto_{args.device}.md").write_text("\n".join(lines) + "\n")
    (out / f"trl_auto_{args.device}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
