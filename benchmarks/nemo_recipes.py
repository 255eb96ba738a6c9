"""NeMo AutoModel's published recipes through remat (issue #36): every ``examples/llm_finetune`` and
``examples/llm_pretrain`` recipe of a NeMo AutoModel checkout read as written (``remat finetune RECIPE
--print-config``, offline, no Hub id cached: accepted, refused in one round, or a traceback; each refused one read
again with the keys it was refused for taken out, to find a problem said a round late), and ``remat estimate``
of five representative recipes from their models' published config.json alone (a temporary HF cache holding that
file and nothing else: no weights, no tokenizer, no data). Writes benchmarks/results/nemo_recipes.{md,json}.

    git clone https://github.com/NVIDIA-NeMo/Automodel /tmp/automodel
    .venv/bin/python benchmarks/nemo_recipes.py --nemo /tmp/automodel [--skip-estimates]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]

#: (recipe under examples/, the model it names, remat estimate's extra arguments): the five of issue #36.
REPRESENTATIVE: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("llm_finetune/llama3_2/llama3_2_1b_squad.yaml", "meta-llama/Llama-3.2-1B", ("--world-size", "8")),
    ("llm_finetune/qwen/qwen3_0p6b_packed_cp2.yaml", "Qwen/Qwen3-0.6B", ("--world-size", "2")),
    ("llm_finetune/qwen/qwen3_moe_30b_hellaswag.yaml", "Qwen/Qwen3-30B-A3B", ("--world-size", "8")),
    ("llm_finetune/gemma/gemma_3_270m_squad.yaml", "google/gemma-3-270m", ("--world-size", "8")),
    ("llm_pretrain/llama3_70b_pretrain.yaml", "meta-llama/Llama-3.1-70B", ()),
)


def published_configs() -> dict[str, dict[str, Any]]:
    """The five models' config.json as published on the Hub: remat's presets of those shapes (written from those
    files) plus what the files add, and the two models remat has no preset of, as their files read."""
    from remat.models.presets import PRESETS

    def preset(name: str, architecture: str) -> dict[str, Any]:
        return {"architectures": [architecture], **PRESETS[name].config, "torch_dtype": "bfloat16"}

    return {
        "meta-llama/Llama-3.2-1B": preset("llama-3.2-1b", "LlamaForCausalLM"),
        "Qwen/Qwen3-0.6B": preset("qwen3-0.6b", "Qwen3ForCausalLM"),
        "Qwen/Qwen3-30B-A3B": preset("qwen3-30b-a3b", "Qwen3MoeForCausalLM"),
        "meta-llama/Llama-3.1-70B": {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
            "hidden_size": 8192, "initializer_range": 0.02, "intermediate_size": 28672,
            "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 64,
            "num_hidden_layers": 80, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
            "vocab_size": 128256},
        "google/gemma-3-270m": {
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "_sliding_window_pattern": 6,
            "attention_bias": False, "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2,
            "eos_token_id": 1, "final_logit_softcapping": None, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640, "initializer_range": 0.02,
            "intermediate_size": 2048, "max_position_embeddings": 32768, "num_attention_heads": 4,
            "num_hidden_layers": 18, "num_key_value_heads": 1, "pad_token_id": 0, "query_pre_attn_scalar": 256,
            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
            "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
            "sliding_window": 512, "torch_dtype": "bfloat16", "use_bidirectional_attention": False,
            "use_cache": True, "vocab_size": 262144},
    }


#: Sections remat drops whole (a CI harness's and a launcher's): their sub-keys are counted as the section.
WHOLE_SECTIONS: tuple[str, ...] = ("ci", "skypilot")


def recipe_keys(data: Any, prefix: str = "") -> set[str]:
    """The dotted keys of a recipe mapping down to its leaves (a ``_target_`` included; `WHOLE_SECTIONS` as one)."""
    keys: set[str] = set()
    for key, value in (data.items() if isinstance(data, dict) else ()):
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value and dotted not in WHOLE_SECTIONS:
            keys |= recipe_keys(value, dotted)
        else:
            keys.add(dotted)
    return keys


def sweep(nemo: Path) -> dict[str, dict[str, Any]]:
    """``--print-config`` of every published LLM recipe, in this process, offline with an empty HF cache."""
    from remat.cli import main

    results = {}
    recipes = sorted([*nemo.glob("examples/llm_finetune/**/*.yaml"), *nemo.glob("examples/llm_pretrain/**/*.yaml")])
    for index, path in enumerate(recipes, 1):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                code: Any = main(["finetune", str(path), "--print-config"])
            except SystemExit as stop:
                code = stop.code
            except Exception as crash:  # noqa: BLE001 (a traceback is what this counts)
                code = f"traceback {type(crash).__name__}: {crash}"
        lines = [line.removeprefix("error: ") for line in err.getvalue().splitlines()]  # one problem: "error: KEY: ..."
        refused = [line for line in lines if re.match(r"^[a-z_][\w.\[\]]*[:\s]", line)
                   and not line.startswith(("[remat]", "a NeMo AutoModel recipe", "invalid recipe"))]
        keys = sorted(recipe_keys(yaml.safe_load(path.read_text())))
        results[str(path.relative_to(nemo))] = {"code": code, "refused": refused, "all_keys": keys}
        if code in (0, None):
            results[str(path.relative_to(nemo))]["keys"] = keys
        print(f"[{index}/{len(recipes)}] {path.name}: {'accepted' if code in (0, None) else code}", file=sys.stderr)
    return results


def _key(line: str) -> str:
    return line.split(":", 1)[0].split(" ", 1)[0]


def second_round(nemo: Path, results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each refused recipe with every key it was refused for taken out (a refused class with its section: what its
    line asks, a key removed or a size back at its default, short of writing the user's own data), read again. A key
    refused now that the first round did not name is a problem said a round late."""
    with tempfile.TemporaryDirectory() as work:
        root = Path(work)
        for name, result in results.items():
            if result["code"] in (0, None) or isinstance(result["code"], str):
                continue
            data = yaml.safe_load((nemo / name).read_text())
            optimizer = data.get("optimizer")
            if "optimizer._target_" in {_key(line) for line in result["refused"]} and isinstance(optimizer, dict):
                # the line asks for a class remat builds: torch's AdamW at the recipe's learning rate
                data["optimizer"] = {"_target_": "torch.optim.AdamW", **({"lr": optimizer["lr"]} if "lr" in optimizer
                                                                         else {})}
            for line in result["refused"]:
                if _key(line) in ("optimizer._target_", "model"):  # "model": a source to write, not a key to remove
                    continue
                *parents, last = _key(line).removesuffix("._target_").split(".")
                section = data
                for part in parents:
                    section = section.get(part) if isinstance(section, dict) else None
                if isinstance(section, dict):
                    section.pop(last, None)
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(yaml.safe_dump(data))
        again = sweep(root)
    for name, result in again.items():
        first = {_key(line) for line in results[name]["refused"]}
        result["new"] = sorted({_key(line) for line in result["refused"]} - first)
    return again


def estimates(nemo: Path) -> list[dict[str, Any]]:
    """``remat estimate`` of the five representative recipes, each in a fresh process reading a temporary HF cache
    that holds only the model's config.json, offline."""
    rows = []
    with tempfile.TemporaryDirectory() as work:
        hub = Path(work) / "hub"
        for hub_id, config in published_configs().items():
            snapshot = hub / f"models--{hub_id.replace('/', '--')}" / "snapshots" / ("0" * 40)
            snapshot.mkdir(parents=True)
            (snapshot / "config.json").write_text(json.dumps(config))
            (snapshot.parents[1] / "refs").mkdir()
            (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
        env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HOME": str(Path(work) / "home"), "HF_HUB_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(Path(work) / "datasets")}
        for recipe, hub_id, extra in REPRESENTATIVE:
            out = Path(work) / "estimate.json"
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "remat.cli", "estimate", str(nemo / "examples" / recipe),
                                   *extra, "--json", str(out)], env=env, capture_output=True, text=True, timeout=1800)
            row: dict[str, Any] = {"recipe": recipe, "model": hub_id, "arguments": " ".join(extra),
                                   "exit": proc.returncode, "seconds": round(time.perf_counter() - start, 1),
                                   "said": [line.split("NeMo AutoModel recipe: ", 1)[1] for line in
                                            proc.stderr.splitlines() if "estimated as" in line],
                                   "data_read": (Path(work) / "datasets").exists()}
            if proc.returncode == 0:
                estimate = json.loads(out.read_text())
                first = estimate[0] if isinstance(estimate, list) else estimate.get("estimates", [estimate])[0]
                row.update(peak_gib=round(first["peak_bytes"] / 2**30, 2), label=first.get("label", ""),
                           settings={k: first["settings"].get(k) for k in ("strategy", "world_size", "cp_size",
                                                                           "tp_size", "batch_size", "seq_length",
                                                                           "dtype", "policy")})
            else:
                row["error"] = proc.stderr.strip().splitlines()[-3:]
            rows.append(row)
            print(f"{recipe}: exit {proc.returncode}, {row.get('peak_gib')} GiB", file=sys.stderr)
    return rows


def write(results: dict[str, Any], rows: list[dict[str, Any]], out: Path, nemo: Path,
          again: dict[str, Any] | None = None) -> None:
    import torch
    import transformers

    accepted = sum(r["code"] in (0, None) for r in results.values())
    crashed = sum(isinstance(r["code"], str) for r in results.values())
    keys = Counter(line.split(":", 1)[0].split(" ", 1)[0] for r in results.values() for line in r["refused"])
    commit = subprocess.run(["git", "-C", str(nemo), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    lines = [f"# NeMo AutoModel's published recipes through remat ({datetime.date.today()})", "",
             f"NeMo AutoModel at {commit or 'an unknown commit'}; torch {torch.__version__}, transformers "
             f"{transformers.__version__}; `benchmarks/nemo_recipes.py`.", "",
             f"**`remat finetune RECIPE --print-config`** (offline, no Hub id cached), {len(results)} recipes: "
             f"**{accepted} accepted as written**, {len(results) - accepted - crashed} refused in one round, "
             f"{crashed} tracebacks.", ""]
    if again:
        late = {name: result["new"] for name, result in again.items() if result["new"]}
        passed = sum(result["code"] in (0, None) for result in again.values())
        lines += ["**One round**: each refused recipe with every key it was refused for taken out (a refused "
                  f"optimizer class replaced by torch's AdamW), read again: {passed} of {len(again)} accepted, "
                  f"{len(again) - passed - len(late)} still refused only for keys the first round named, {len(late)} "
                  "with a key refused a round late" + (":" if late else "."), "",
                  *(f"- `{name}`: {', '.join(f'`{key}`' for key in keys)}" for name, keys in sorted(late.items())),
                  *([""] if late else [])]
    lines += ["Keys refused, most common first:", "", "| key | recipes |", "|---|---|",
              *(f"| `{key}` | {count} |" for key, count in keys.most_common()), ""]
    if rows:
        lines += ["**`remat estimate RECIPE`** of the five representative recipes, from the model's config.json alone "
                  "(no weights, tokenizer or data read; each in a fresh process, offline):", "",
                  "| recipe | model | arguments | peak per GPU | layout | data read | seconds | estimated as |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in rows:
            s = row.get("settings", {})
            layout = (f"{s.get('strategy')} x{s.get('world_size')}, tp {s.get('tp_size')}, cp {s.get('cp_size')}; "
                      f"{s.get('batch_size')} x {s.get('seq_length')}, {s.get('dtype')}, {s.get('policy')}"
                      if s else "; ".join(row.get("error", [])))
            peak = f"{row['peak_gib']} GiB" if "peak_gib" in row else f"exit {row['exit']}"
            lines.append(f"| `{row['recipe']}` | {row['model']} | {row['arguments'] or '-'} | {peak} | {layout} | "
                         f"{'yes' if row['data_read'] else 'no'} | {row['seconds']} | "
                         f"{'; '.join(row['said']) or '-'} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "nemo_recipes.md").write_text("\n".join(lines) + "\n")
    used = sorted({key for result in results.values() for key in result.get("keys", ())})
    every = sorted({key for result in results.values() for key in result.get("all_keys", ())})
    def lean(sweep: dict[str, Any]) -> dict[str, Any]:  # each recipe's keys are in the two inventories
        return {name: {k: v for k, v in result.items() if k not in ("keys", "all_keys")}
                for name, result in sweep.items()}

    results, again = lean(results), lean(again or {})
    (out / "nemo_recipes.json").write_text(json.dumps({"sweep": results, "estimates": rows, "accepted_keys": used,
                                                       "published_keys": every,
                                                       "second_round": again}, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nemo", type=Path, required=True, help="a NeMo AutoModel checkout")
    parser.add_argument("--skip-estimates", action="store_true",
                        help="sweep only; the table keeps the estimates of the last full run")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as empty:
        os.environ.update(HF_HUB_OFFLINE="1", HF_HOME=empty, HF_HUB_CACHE=str(Path(empty) / "hub"))
        results = sweep(args.nemo)
        again = second_round(args.nemo, results)
    previous = args.out / "nemo_recipes.json"
    rows = (json.loads(previous.read_text()).get("estimates", []) if previous.exists() else []) \
        if args.skip_estimates else estimates(args.nemo)
    write(results, rows, args.out, args.nemo, again)
    print(f"wrote {args.out / 'nemo_recipes.md'}")


if __name__ == "__main__":
    main()
