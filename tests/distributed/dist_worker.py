"""What each torchrun worker of the distributed tests runs: ``python dist_worker.py MODE OUT_DIR``.

Modes: ``parity`` trains every case of ``PARITY_CASES`` and records losses, gradient norms, validation and how the
parameters are sharded, then trains with the FSDP2 options the recipe schema does not expose (deferred gradient
reduction, bf16 mixed precision, CPU offload) through the Python API; ``resume`` trains a run straight, and the same
run crashing after its step-4 checkpoint and resumed, for fsdp2 and ddp, and stops a run from one rank; ``nccl`` trains
a few parity cases on 2 GPUs; ``corrupt`` resumes past a corrupted fsdp2 shard; ``context`` trains
``CONTEXT_CASES`` with ``cp_size`` 2 and resumes a crashed ``cp_size`` 2 run with ``cp_size`` 2 and with 1; ``lora``
trains LoRA adapters under FSDP2 straight and crashed-and-resumed; ``qlora`` trains them over 4-bit base weights; ``qat`` trains with fake-quantising linear layers. Everything but ``nccl`` runs on the CPU (gloo), GPUs or not. Each rank
writes ``<mode>_rank<r>.json`` into OUT_DIR; the tests read and judge them.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_recipes import PARITY_CASES, leave_process_group, tiny_recipe

from remat.recipes.finetune import FinetuneRecipe, RunResult
from remat.recipes.loader import validate_recipe


def train(recipe: dict[str, Any], callbacks: list[Any] | None = None) -> tuple[FinetuneRecipe, RunResult]:
    job = FinetuneRecipe(validate_recipe(recipe), callbacks=callbacks)
    return job, job.run()


def curve(result: RunResult) -> dict[str, Any]:
    return {"loss": [r.loss for r in result.records], "grad_norm": [r.grad_norm for r in result.records],
            "tokens": [r.num_label_tokens for r in result.records], "mem": [r.mem_bytes for r in result.records],
            "validation": result.validation, "steps": [r.step for r in result.records]}


def shards(job: FinetuneRecipe) -> dict[str, list[Any]]:
    """name -> [local numel, full numel, placements] of every parameter (placements empty for plain tensors)."""
    out = {}
    for name, param in job.model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        out[name] = [local.numel(), param.numel(), [str(p) for p in getattr(param, "placements", ())]]
    return out


def parity(out: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, (strategy, checkpointing, fused, tied, tp_size) in PARITY_CASES.items():
        job, result = train(tiny_recipe(out / name, strategy=strategy, checkpointing=checkpointing, fused=fused,
                                        tied=tied, tp_size=tp_size))
        report[name] = {**curve(result), "shards": shards(job), "blocks": len(job.dist.plan or ())}
    report["fsdp2-options"] = fsdp2_options()
    report["tp-families"] = tp_families()
    return report


FSDP2_OPTIONS: dict[str, dict[str, Any]] = {
    "reference": {},
    "deferred-reduction": {"fsdp_reduce_every_micro_batch": False},
    "bf16": {"mixed_precision": "bfloat16"},
    "cpu-offload": {"cpu_offload": True},
}


def fsdp2_options(steps: int = 3) -> dict[str, Any]:
    """A hand-written loop over DistributedSetup with each option: global losses, grad norms, parameter dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from remat.distributed import DistributedSetup, clip_grad_norm
    from remat.loss import FusedLinearCrossEntropy
    from remat.recipes.model_loss import CausalLMLoss

    report = {}
    for name, options in FSDP2_OPTIONS.items():
        setup = DistributedSetup.build("fsdp2", activation_checkpointing="full", device="cpu", **options)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False))
        root = setup.parallelize(model, root=CausalLMLoss(model, FusedLinearCrossEntropy(), use_hidden_states=True))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(1)
        losses, norms = [], []
        for _ in range(steps):
            ids = torch.randint(0, 256, (8, 16), generator=generator)
            tokens = ids[:, 1:].numel()
            local = 0.0
            micro_batches = ids.chunk(setup.dp_size)[setup.dp_rank].chunk(2)
            for index, batch in enumerate(micro_batches):
                with setup.gradient_sync(enabled=index == len(micro_batches) - 1):
                    loss = root({"input_ids": batch, "labels": batch}, num_label_tokens=tokens)
                    (loss * setup.dp_size).backward()
                local += loss.item()
            norms.append(clip_grad_norm(model.parameters(), 1.0))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(setup.sum_over_dp([local])[0])
        param = next(model.parameters())
        report[name] = {"loss": losses, "grad_norm": norms, "param": [str(param.dtype), type(param).__name__]}
    return report


def tp_families() -> dict[str, list[float]]:
    """Every family of TP_PLANS split over the 2 ranks: |loss - one-process loss| and the largest gradient error."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from remat.distributed import DistributedSetup
    from remat.distributed.tensor_parallel import TP_PLANS
    from remat.loss import MaskedCrossEntropy
    from remat.recipes.model_loss import CausalLMLoss

    report = {}
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids}
    for model_type in TP_PLANS:
        config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128, head_dim=16,
                                      attn_implementation="eager")
        torch.manual_seed(0)
        reference = AutoModelForCausalLM.from_config(config)
        model = copy.deepcopy(reference)
        expected = CausalLMLoss(reference, MaskedCrossEntropy(), use_hidden_states=False)(batch)
        expected.backward()
        setup = DistributedSetup.build("fsdp2", tp_size=2, device="cpu")
        root = setup.parallelize(model, root=CausalLMLoss(model, MaskedCrossEntropy(), use_hidden_states=False))
        loss = root(batch)
        loss.backward()
        errors = [(p.grad.full_tensor() - q.grad).abs().max().item()
                  for p, q in zip(model.parameters(), reference.parameters(), strict=True)]
        report[model_type] = [abs(loss.item() - expected.item()), max(errors)]
    return report


class Crash(RuntimeError):
    """A simulated failure in the middle of a run (after a checkpoint was saved)."""


def crash_at(step: int) -> Any:
    def callback(job: FinetuneRecipe, record: Any) -> None:
        if record.step == step:
            raise Crash(f"simulated crash at step {step}")
    return callback


def resume(out: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for strategy in ("fsdp2", "ddp"):
        def recipe(name: str, strategy: str = strategy) -> dict[str, Any]:
            return tiny_recipe(out / name, strategy=strategy, checkpointing="full", fused=strategy == "fsdp2",
                               max_steps=6, step_scheduler={"ckpt_every_steps": 2, "val_every_steps": 3},
                               checkpoint={"enabled": True, "keep_last": 3})

        _, straight = train(recipe(f"{strategy}-straight"))
        try:
            train(recipe(f"{strategy}-crashed"), callbacks=[crash_at(5)])
            raise AssertionError("the crash callback did not fire")
        except Crash:
            pass
        job, resumed = train(recipe(f"{strategy}-crashed"))
        report[strategy] = {"straight": curve(straight), "resumed": curve(resumed),
                            "resumed_from": str(job.resumed_from)}
    report["stop-on-one-rank"] = stop_on_one_rank(out / "fsdp2-stopped")
    return report


#: name -> (strategy, checkpointing, fused loss, tied embeddings), each with cp_size 2 over the 2 ranks (dp 1).
CONTEXT_CASES: dict[str, tuple[str, Any, bool, bool]] = {
    "ddp-cp2-auto": ("ddp", {"mode": "auto", "memory_budget": 2_800_000}, False, True),  # planned per rank
    "ddp-cp2-full": ("ddp", "full", False, True),
    "fsdp2-cp2-selective-fused": ("fsdp2", "selective", True, False),
}


def context(out: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, (strategy, checkpointing, fused, tied) in CONTEXT_CASES.items():
        cfg = validate_recipe(tiny_recipe(out / name, strategy=strategy, checkpointing=checkpointing, fused=fused,
                                          tied=tied, cp_size=2))
        if cfg.distributed.auto is not None:  # each rank plans alike, before any process group exists
            from remat.planner import plan_recipe_auto

            cfg, _ = plan_recipe_auto(cfg, world_size=2)
        job = FinetuneRecipe(cfg)
        result = job.run()
        report[name] = {**curve(result), "plan": cfg.distributed.policy.describe()}

    def recipe(name: str, cp_size: int = 2) -> dict[str, Any]:
        return tiny_recipe(out / name, strategy="fsdp2", checkpointing="full", cp_size=cp_size, max_steps=6,
                           step_scheduler={"ckpt_every_steps": 2, "val_every_steps": 3},
                           checkpoint={"enabled": True, "keep_last": 3})

    _, straight = train(recipe("straight"))
    report["straight"] = curve(straight)
    for name, cp_size in (("resumed-cp2", 2), ("resumed-cp1", 1)):
        try:
            train(recipe(name), callbacks=[crash_at(5)])
            raise AssertionError("the crash callback did not fire")
        except Crash:
            pass
        job, resumed = train(recipe(name, cp_size))
        report[name] = {**curve(resumed), "resumed_from": str(job.resumed_from), "describe": job.dist.describe()}
    return report


def resume_saying(recipe: dict[str, Any], first: RunResult) -> dict[str, Any]:
    """Run ``recipe`` again (it resumes), with what remat's checkpoint verification said on this rank."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("remat.training_state.verify").addHandler(handler)
    job, resumed = train(recipe)
    return {"first": curve(first), "resumed": curve(resumed), "resumed_from": str(job.resumed_from), "said": said}


def corrupt_shard(out: Path) -> dict[str, Any]:
    """fsdp2 checkpoints step_2 and step_4, then one byte of rank 1's DCP shard of step_4 changed (same size): the
    next run skips step_4 on every rank (rank 0 verifies, all follow) and continues from step_2."""
    recipe = tiny_recipe(out, strategy="fsdp2", max_steps=4, step_scheduler={"ckpt_every_steps": 2,
                         "val_every_steps": None}, checkpoint={"enabled": True, "keep_last": 3})
    _, first = train(recipe)
    shard = out / "checkpoints" / "step_4" / "dcp" / "__1_0.distcp"
    if dist.get_rank() == 0:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x5A
        shard.write_bytes(bytes(data))
    dist.barrier()
    return resume_saying(recipe, first)


def stop_on_one_rank(out: Path) -> dict[str, Any]:
    """Only rank 1 is asked to stop (as by a signal that reached one process): every rank stops after that step
    and they save one checkpoint together."""
    def request_on_rank_1(job: FinetuneRecipe, record: Any) -> None:
        if record.step == 2 and dist.get_rank() == 1:
            job.request_stop("test request on rank 1")

    _, result = train(tiny_recipe(out, strategy="fsdp2", max_steps=5, checkpoint={"enabled": True}),
                      callbacks=[request_on_rank_1])
    return {"final_step": result.final_step, "stopped_early": result.stopped_early,
            "last_checkpoint": str(result.last_checkpoint)}


#: The cases the ``nccl`` mode trains on 2 GPUs (one per rank), against a single-process run on one GPU.
NCCL_CASES: tuple[str, ...] = ("fsdp2-full", "ddp-full")


def nccl(out: Path) -> dict[str, Any]:
    """``PARITY_CASES`` entries with ``distributed.device: cuda``: NCCL, one GPU per rank."""
    report: dict[str, Any] = {}
    for name in NCCL_CASES:
        strategy, checkpointing, fused, tied, tp_size = PARITY_CASES[name]
        job, result = train(tiny_recipe(out / name, strategy=strategy, checkpointing=checkpointing, fused=fused,
                                        tied=tied, tp_size=tp_size, device="cuda"))
        report[name] = {**curve(result), "describe": job.dist.describe(), "device": str(job.dist.device),
                        "mem_source": [r.mem_source for r in result.records]}
    return report


def damaged_rank_file(out: Path) -> dict[str, Any]:
    """fsdp2 checkpoints step_2 and step_4, then rank 0's own file of step_4 (``rng/rank_0.pt``) replaced by garbage and
    the manifest rewritten to match (verification passes): only rank 0's read fails, before the collective load. Every
    rank must fall back to step_2 together (before, rank 1 waited in the collective load forever)."""
    import hashlib

    recipe = tiny_recipe(out, strategy="fsdp2", max_steps=4, step_scheduler={"ckpt_every_steps": 2,
                         "val_every_steps": None}, checkpoint={"enabled": True, "keep_last": 3})
    _, first = train(recipe)
    step_4 = out / "checkpoints" / "step_4"
    if dist.get_rank() == 0:
        garbage = b"not a torch file " * 64
        (step_4 / "rng" / "rank_0.pt").write_bytes(garbage)
        marker = json.loads((step_4 / "COMPLETE.json").read_text())
        marker["files"]["rng/rank_0.pt"] = {"size": len(garbage), "sha256": hashlib.sha256(garbage).hexdigest()}
        (step_4 / "COMPLETE.json").write_text(json.dumps(marker))
    dist.barrier()
    return resume_saying(recipe, first)


def lora_recipe(output_dir: Path, strategy: str = "fsdp2") -> dict[str, Any]:
    """The tiny recipe with LoRA adapters (rank 4 on every linear layer), checkpointed every 2 of 4 steps."""
    return tiny_recipe(output_dir, strategy=strategy, checkpointing="full", max_steps=4, peft={"r": 4},
                       step_scheduler={"ckpt_every_steps": 2, "val_every_steps": None},
                       checkpoint={"enabled": True, "keep_last": 3})


def lora(out: Path) -> dict[str, Any]:
    """LoRA under FSDP2: a straight run, and the same run crashing after its step-2 checkpoint and resumed."""
    _, straight = train(lora_recipe(out / "straight"))
    try:
        train(lora_recipe(out / "crashed"), callbacks=[crash_at(3)])
        raise AssertionError("the crash callback did not fire")
    except Crash:
        pass
    job, resumed = train(lora_recipe(out / "crashed"))
    return {"straight": curve(straight), "resumed": curve(resumed), "resumed_from": str(job.resumed_from)}


def qlora_recipe(output_dir: Path, base: Path, strategy: str = "fsdp2") -> dict[str, Any]:
    """``lora_recipe`` over the pretrained checkpoint ``base`` quantised to 4 bits (QLoRA), 3 steps, one checkpoint."""
    recipe = lora_recipe(output_dir, strategy)
    recipe["step_scheduler"]["max_steps"] = 3
    recipe["model"] = {"pretrained_model_name_or_path": str(base),
                       "quantization": {"load_in_4bit": True, "bnb_4bit_use_double_quant": True}}
    return recipe


def qlora(out: Path) -> dict[str, Any]:
    """QLoRA under FSDP2 over the checkpoint the test wrote in ``out/base``."""
    _, result = train(qlora_recipe(out / "run", out / "base"))
    return curve(result)


def qat_recipe(output_dir: Path, strategy: str = "fsdp2") -> dict[str, Any]:
    """The tiny recipe trained with torchao's fake-quantising linear layers (int8 activations, int4 weights)."""
    return tiny_recipe(output_dir, strategy=strategy, checkpointing="full", max_steps=3,
                       qat={"enabled": True, "groupsize": 32, "fake_quant_after_n_steps": 1})


def qat(out: Path) -> dict[str, Any]:
    """Quantization-aware training under FSDP2, with how many fake-quantising layers are on after the run."""
    job, result = train(qat_recipe(out / "run"))
    on = sum(type(m).__name__.endswith("QATLinear") and bool(m.weight_fake_quantizer.enabled)
             for m in job.model.modules())
    return {**curve(result), "fake_quantising": on}


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    report = {"parity": parity, "resume": resume, "nccl": nccl, "corrupt": corrupt_shard,
              "damaged_rank_file": damaged_rank_file, "context": context, "lora": lora,
              "qlora": qlora, "qat": qat}[mode](out)
    (out / f"{mode}_rank{dist.get_rank()}.json").write_text(json.dumps(report))
    leave_process_group()


if __name__ == "__main__":
    main()
