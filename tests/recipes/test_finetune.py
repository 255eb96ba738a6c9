"""The fine-tuning recipe end to end on a tiny model: training, accumulation, resume, signals, checkpoints, LoRA."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from remat.errors import ConfigError
from remat.recipes.finetune import FinetuneRecipe, RunResult
from remat.recipes.loader import validate_recipe
from tiny import TINY_LLAMA_PRESET
from tiny import tiny_recipe as shared_tiny_recipe


def tiny_recipe(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    """The shared tiny recipe (`tiny.tiny_recipe`) writing under ``tmp_path / "run"``."""
    return shared_tiny_recipe(**{"output_dir": str(tmp_path / "run"), **sections})


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    # One tokenizer cache for the whole module keeps the builtin BPE trained once.
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "remat-cache"))


def run(recipe: dict[str, Any], **kwargs: Any) -> tuple[FinetuneRecipe, RunResult]:
    job = FinetuneRecipe(validate_recipe(recipe), **kwargs)
    return job, job.run()


def losses(result: RunResult) -> list[float]:
    return [r.loss for r in result.records]


def test_trains_logs_and_loss_falls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, result = run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 20}, checkpoint={"enabled": False}))
    out = capsys.readouterr().out
    assert [r.step for r in result.records] == list(range(1, 21))
    assert sum(losses(result)[-3:]) / 3 < losses(result)[0] - 0.5
    step_lines = [line for line in out.splitlines() if line.startswith("step ") and "| loss " in line]
    assert len(step_lines) == 20
    assert all(" GiB | tps " in line and "| num_label_tokens " in line for line in step_lines)
    assert "mem: exact peak of live tensor bytes" in out
    assert "activation checkpointing: off" in out
    assert all(r.mem_source == "tracked" and r.mem_bytes > 0 for r in result.records)
    # The end of the run: its summary and a report.png beside the metrics.
    assert "trained steps 1-20 in " in out and f"report: {tmp_path / 'run' / 'report.png'}" in out
    assert (tmp_path / "run" / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_accumulation_equals_one_big_batch(tmp_path: Path) -> None:
    common = {"checkpoint": {"enabled": False}, "lr_scheduler": {"warmup_steps": 0, "decay": "constant"}}
    _, big = run(tiny_recipe(tmp_path / "a", step_scheduler={"global_batch_size": 4, "local_batch_size": 4,
                                                                  "max_steps": 3}, **common))
    _, acc = run(tiny_recipe(tmp_path / "b", step_scheduler={"global_batch_size": 4, "local_batch_size": 1,
                                                                  "max_steps": 3}, **common))
    assert [r.num_label_tokens for r in big.records] == [r.num_label_tokens for r in acc.records]
    torch.testing.assert_close(torch.tensor(losses(acc)), torch.tensor(losses(big)), rtol=1e-5, atol=1e-5)


def test_resume_continues_the_same_loss_curve(tmp_path: Path) -> None:
    _, straight = run(tiny_recipe(tmp_path / "straight"))

    def stop_after_three(job: FinetuneRecipe, record: Any) -> None:
        if record.step == 3:
            job.request_stop("test")

    interrupted_recipe = tiny_recipe(tmp_path / "interrupted")
    _, first = run(interrupted_recipe, callbacks=[stop_after_three])
    assert first.stopped_early and first.final_step == 3
    assert first.last_checkpoint is not None and first.last_checkpoint.name == "step_3"
    job, second = run(interrupted_recipe)
    assert job.resumed_from == first.last_checkpoint
    assert [r.step for r in second.records] == [4, 5, 6]
    assert losses(first) + losses(second) == losses(straight)


def test_sigterm_saves_and_stops_cleanly(tmp_path: Path) -> None:
    def send_sigterm(job: FinetuneRecipe, record: Any) -> None:
        if record.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    _, result = run(tiny_recipe(tmp_path), callbacks=[send_sigterm])
    assert result.stopped_early and result.final_step == 2 and result.exit_code == 128 + signal.SIGTERM == 143
    assert result.last_checkpoint is not None and (result.last_checkpoint / "model" / "config.json").is_file()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_saved_model_reloads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    job, result = run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 2}))
    assert result.last_checkpoint is not None
    reloaded = AutoModelForCausalLM.from_pretrained(result.last_checkpoint / "model")
    ids = torch.randint(0, 500, (1, 16))
    job.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, job.model(ids).logits)


def test_finished_run_does_nothing_and_resume_never_refuses(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 2})
    run(recipe)
    _, again = run(recipe)
    assert again.records == [] and "nothing to do" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="checkpoint.resume: 'never' but .* already holds checkpoints"):
        run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 2}, checkpoint={"resume": "never"}))


def test_validation_loss_is_reported(tmp_path: Path) -> None:
    _, result = run(tiny_recipe(tmp_path, step_scheduler={"max_steps": 4, "val_every_steps": 2},
                                validation_dataset={"split": "validation", "seq_length": 32},
                                checkpoint={"enabled": False}))
    assert [step for step, _ in result.validation] == [2, 4]
    assert all(0 < loss < 10 for _, loss in result.validation)


def test_lora_trains_only_adapters(tmp_path: Path) -> None:
    job, result = run(tiny_recipe(tmp_path, peft={"r": 4, "lora_alpha": 8},
                                  optimizer={"lr": 1e-2}, step_scheduler={"max_steps": 8}))
    trainable = [n for n, p in job.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert losses(result)[-1] < losses(result)[0]
    assert result.last_checkpoint is not None and (result.last_checkpoint / "adapter").is_dir()


@pytest.mark.parametrize("policy", ["full", "selective", {"mode": "full", "every_n_layers": 2}])
def test_checkpointing_policy_leaves_the_loss_curve_unchanged(tmp_path: Path, policy: Any) -> None:
    base = {"checkpoint": {"enabled": False}, "step_scheduler": {"max_steps": 3}}
    _, plain = run(tiny_recipe(tmp_path / "plain", **base))
    job, ckpt = run(tiny_recipe(tmp_path / "ckpt", distributed={"activation_checkpointing": policy}, **base))
    assert job.dist.plan is not None and len(job.dist.plan) > 0
    torch.testing.assert_close(torch.tensor(losses(ckpt)), torch.tensor(losses(plain)), rtol=1e-6, atol=1e-6)


def test_fused_loss_gives_the_plain_loss_curve(tmp_path: Path) -> None:
    base = {"checkpoint": {"enabled": False}, "step_scheduler": {"max_steps": 4}}
    _, plain = run(tiny_recipe(tmp_path / "plain", **base))
    job, fused = run(tiny_recipe(tmp_path / "fused", loss_fn={"_target_": "remat.loss.FusedLinearCrossEntropy"},
                                 model={**TINY_LLAMA_PRESET, "output_hidden_states": True}, **base))
    assert type(job.compute_loss.loss_fn).__name__ == "FusedLinearCrossEntropy"
    torch.testing.assert_close(torch.tensor(losses(fused)), torch.tensor(losses(plain)), rtol=1e-5, atol=1e-5)


def test_fused_loss_takes_the_models_softcap(tmp_path: Path) -> None:
    from remat.loss import FusedLinearCrossEntropy
    from remat.recipes.model_loss import CausalLMLoss
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma2", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
                                  final_logit_softcapping=30.0, attn_implementation="eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    from remat.loss import MaskedCrossEntropy

    fused = CausalLMLoss(model, FusedLinearCrossEntropy(), use_hidden_states=True)
    plain = CausalLMLoss(model, MaskedCrossEntropy(), use_hidden_states=False)
    assert fused.loss_fn.logit_softcap == 30.0
    torch.testing.assert_close(fused(batch), plain(batch), rtol=1e-5, atol=1e-5)


def test_a_diverged_step_stops_the_run_and_saves_nothing(tmp_path: Path) -> None:
    from remat.errors import TrainingDivergedError

    recipe = tiny_recipe(tmp_path, step_scheduler={"max_steps": 6, "ckpt_every_steps": 2},
                         checkpoint={"keep_last": 1})
    good, _ = run(recipe | {"step_scheduler": {**recipe["step_scheduler"], "max_steps": 2}})
    saved = sorted(p.name for p in good.checkpoint_dir.iterdir())

    def poison(job: FinetuneRecipe, record: Any) -> None:  # weights become NaN after the first resumed step
        if record.step == 3:
            with torch.no_grad():
                next(job.model.parameters()).fill_(float("nan"))

    with pytest.raises(TrainingDivergedError, match=r"step 4: loss nan and grad_norm nan: training diverged "
                                                     r"\(training.on_nonfinite: stop\); the update was not applied and "
                                                     r"the run stops without saving \(the last good checkpoint is "
                                                     r".*step_2\)"):
        run(recipe, callbacks=[poison])
    # Nothing new was saved from the broken weights, and the good checkpoint was not pruned.
    assert sorted(p.name for p in good.checkpoint_dir.iterdir()) == saved


@pytest.mark.gpus(1)
def test_auto_device_trains_on_the_gpu_and_logs_the_allocator_peak(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    job, result = run(tiny_recipe(tmp_path, distributed={"device": "auto"}, checkpoint={"enabled": False}))
    out = capsys.readouterr().out
    assert job.dist.device == torch.device("cuda", 0)
    assert {p.device for p in job.model.parameters()} == {torch.device("cuda", 0)}
    assert "mem: peak of the CUDA caching allocator (torch.cuda.max_memory_allocated)" in out
    assert all(r.mem_source == "cuda" and r.mem_bytes > 0 for r in result.records)
    assert losses(result)[-1] < losses(result)[0]


def test_num_epochs_without_max_steps_derives_the_steps_from_the_dataset(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """step_scheduler.num_epochs (NeMo's key, and remat's): 10 rows in global batches of 4 are 2 steps an epoch (the
    last 2 rows wait for the next epoch), so 3 epochs train 6 steps; a max_steps written too wins."""
    import json

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i} " + "word " * 5}) + "\n" for i in range(10)))
    sections = {"dataset": {"path": str(data), "format": "text", "packing": False, "seq_length": 32},
                "checkpoint": {"enabled": False}}
    recipe = tiny_recipe(tmp_path, **sections)
    recipe["step_scheduler"] = {"global_batch_size": 4, "local_batch_size": 2, "num_epochs": 3}
    caplog.set_level("INFO", logger="remat.recipes.finetune")
    job, result = run(recipe)
    assert [r.step for r in result.records] == [1, 2, 3, 4, 5, 6] and job.cfg.step_scheduler.max_steps == 6
    assert "step_scheduler.num_epochs 3 -> max_steps 6 (2 steps of 4 rows per epoch, from 10 rows)" in caplog.text
    recipe["step_scheduler"]["max_steps"] = 1
    recipe["output_dir"] = str(tmp_path / "written")
    _, result = run(recipe)
    assert [r.step for r in result.records] == [1]
