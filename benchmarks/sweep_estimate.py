"""The estimate against the real CPU step on every causal LM transformers ships (issue #23, 1c).

Every model type of transformers' causal-LM mapping is built from a tiny config (the generic shrink of
tests/loss/test_loss_sweep.py); for each that builds and runs its own forward, ``remat.estimate_memory`` with
``target="cpu"`` is compared with the exact tracked peak of the same recipe step run on real CPU tensors (the build
and the step are the recipe's own, as in tests/estimate/test_estimate_vs_real.py). Outcomes: within 0.5%, off (with
the error), refused in one line (remat's own error), or crashed (any other exception or a longer message). Writes
benchmarks/results/sweep_estimate.{json,md}.

    .venv/bin/python benchmarks/sweep_estimate.py [--only llama,mistral] [--plan] [--out benchmarks/results]

``--plan`` also plans ``auto`` (``plan_activation_checkpointing``) for the budget midway between each type's
estimated none and full peaks (1 GiB where the estimate refused: the planner must refuse the same way): planned
within the budget, refused in one line, or crashed.

Models whose expert routing depends on the data are simulated with balanced routing (the estimate says so in a
note); a real step with random weights routes unevenly, so their rows are held to 1% instead of 0.5%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

TOLERANCE = 0.005
ROUTING_TOLERANCE = 0.01  # balanced routing against a random router (see the docstring)
SLIDING_WINDOW = 16  # tokens; the rows have 64
ROOT = Path(__file__).resolve().parents[1]


def _tiny_config(model_type: str) -> dict[str, Any] | None:
    """The tiny config of ``model_type`` as a mapping, or None when the shrink gives nothing that runs."""
    sys.path.insert(0, str(ROOT / "tests" / "loss"))
    from test_loss_sweep import _tiny_model

    model = _tiny_model(model_type)
    if model is None:
        return None
    config = model.config.to_dict()
    layers = config.get("num_hidden_layers", config.get("num_layers"))
    for key, value in list(config.items()):  # the shrink set num_hidden_layers on the object: per-layer lists follow
        if isinstance(layers, int) and "layer" in key and isinstance(value, list) and len(value) > layers:
            config[key] = value[:layers]
    if isinstance(config.get("sliding_window"), int):
        config["sliding_window"] = SLIDING_WINDOW  # shorter than the rows, so the windows bind
    return config


def _real_peak(settings: Any, model: Any) -> int:
    """The tracked peak of the recipe's second step on real CPU tensors (the estimate suite's own reference)."""
    sys.path.insert(0, str(ROOT / "tests" / "estimate"))
    from test_estimate_vs_real import _real_peaks

    return int(_real_peaks(settings, model=model)[1])


def sweep_one(model_type: str, policy: str) -> dict[str, Any]:
    from remat.errors import RematError
    from remat.estimate.api import estimate_memory
    from remat.estimate.settings import StepSettings
    from remat.estimate.simulate import ROUTING_NOTE
    from remat.models import ModelConfig

    config = _tiny_config(model_type)
    if config is None:
        return {"model_type": model_type, "policy": policy, "outcome": "not built"}
    start = time.perf_counter()
    try:
        model = ModelConfig(config=config)
        settings = StepSettings(batch_size=2, seq_length=64, target="cpu", policy=policy, loss="plain")
        estimate = estimate_memory(model, settings)
        real = _real_peak(settings, model)
    except RematError as err:  # remat's own refusals (ConfigError, CheckpointingError, ...)
        one_line = "\n" not in str(err)
        return {"model_type": model_type, "policy": policy, "outcome": "refused" if one_line else "crashed",
                "message": str(err)[:300]}
    except Exception as err:  # noqa: BLE001 (what the sweep is for: anything but a one-line refusal)
        return {"model_type": model_type, "policy": policy, "outcome": "crashed",
                "message": f"{type(err).__name__}: {str(err)[:300]}"}
    error = (estimate.peak_bytes - real) / real
    routed = ROUTING_NOTE in estimate.notes
    if abs(error) <= TOLERANCE:
        outcome = "within 0.5%"
    elif routed and abs(error) <= ROUTING_TOLERANCE:
        outcome = "within 1% (balanced routing)"
    else:
        outcome = "off"
    return {"model_type": model_type, "policy": policy, "estimate": estimate.peak_bytes, "real": real,
            "error": error, "outcome": outcome, "seconds": round(time.perf_counter() - start, 1)}


def plan_one(model_type: str, budget: int) -> dict[str, Any]:
    """``plan_activation_checkpointing`` for ``budget`` bytes: planned (within the budget), refused in one line, or
    crashed."""
    from remat.errors import RematError
    from remat.models import ModelConfig
    from remat.planner import plan_activation_checkpointing

    start = time.perf_counter()
    try:
        plan = plan_activation_checkpointing(ModelConfig(config=_tiny_config(model_type)), memory_budget=budget,
                                             target="cpu", batch_size=2, seq_length=64, loss="plain")
    except RematError as err:
        return {"model_type": model_type, "policy": "auto", "outcome": "refused" if "\n" not in str(err) else
                "crashed", "message": str(err)[:300]}
    except Exception as err:  # noqa: BLE001 (what the sweep is for)
        return {"model_type": model_type, "policy": "auto", "outcome": "crashed",
                "message": f"{type(err).__name__}: {str(err)[:300]}"}
    fits = plan.peak_bytes <= budget
    return {"model_type": model_type, "policy": "auto", "outcome": "planned" if fits else "over budget",
            "estimate": plan.peak_bytes, "budget": budget, "message": plan.policy.describe()[:160],
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging as hf_logging

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: every causal LM)")
    parser.add_argument("--policies", default="none,full")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plan", action="store_true",
                        help="also plan auto midway between the none and full estimates of each type (both needed)")
    args = parser.parse_args(argv)
    from remat.checkpointing import parse_policy
    from remat.errors import RematError

    try:  # a misspelt policy or model type is one line before any model is built
        for policy in args.policies.split(","):
            parse_policy(policy, key="--policies")
    except RematError as err:
        parser.error(str(err))
    types = args.only.split(",") if args.only else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    unknown = sorted(set(types) - set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    if unknown:
        parser.error(f"--only: {', '.join(unknown)} not in transformers' causal-LM mapping")
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    rows = []
    for model_type in types:
        for policy in args.policies.split(","):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row = sweep_one(model_type, policy)
            rows.append(row)
            extra = f" {row['error']:+.3%}" if "error" in row else f" {row.get('message', '')[:100]}"
            print(f"{model_type} {policy}: {row['outcome']}{extra}", flush=True)
            if row["outcome"] == "not built":
                break
        peaks = {row["policy"]: row["estimate"] for row in rows if row["model_type"] == model_type and "estimate" in row}
        if args.plan and rows[-1]["outcome"] != "not built":
            # midway between none and full; where the estimate refused, any budget (the planner must refuse too)
            budget = (peaks["none"] + peaks["full"]) // 2 if {"none", "full"} <= set(peaks) else 2**30
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row = plan_one(model_type, budget)
            rows.append(row)
            print(f"{model_type} auto: {row['outcome']} {row.get('message', '')[:100]}", flush=True)
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    result = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "torch": torch.__version__, "python": platform.python_version(), "tolerance": TOLERANCE,
              "counts": counts, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "sweep_estimate" if not args.only else "sweep_estimate_subset"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# The estimate against the real CPU step, every causal LM in transformers", "",
             f"{result['date']}; torch {torch.__version__}; batch 2 x 64 tokens, float32, plain loss, AdamW, one "
             f"process; tiny configs (tests/loss/test_loss_sweep.py's shrink, sliding windows of {SLIDING_WINDOW} "
             "tokens). Produced by benchmarks/sweep_estimate.py.",
             "", "| outcome | rows |", "| --- | ---: |", *(f"| {k} | {v} |" for k, v in sorted(counts.items())), "",
             "| model type | policy | outcome | error / message |", "| --- | --- | --- | --- |"]
    for row in rows:
        if row["outcome"] == "not built":
            continue
        detail = f"{row['error']:+.3%}" if "error" in row else row.get("message", "").replace("|", "/")[:160]
        if row["outcome"] in ("planned", "over budget"):
            detail = f"{row['estimate']:,} of {row['budget']:,} bytes: {detail}"
        lines.append(f"| {row['model_type']} | {row['policy']} | {row['outcome']} | {detail} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
