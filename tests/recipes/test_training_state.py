"""Checkpoint save/resume: exact round trips, HF-loadable exports (LoRA merged), atomicity under crashes, pruning."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

from remat.errors import ConfigError
from remat.models import ModelConfig, build_model
from remat.training_state import single as single_file_state
from remat.training_state.layout import (
    COMPLETE_MARKER,
    find_latest_checkpoint,
    is_complete_checkpoint,
    list_checkpoints,
)
from remat.training_state.single import load_checkpoint, save_checkpoint

VOCAB = 48
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB, "tie_word_embeddings": True}


def _model(seed: int, config: dict[str, Any] = LLAMA) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(config=config))


def _trainer(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return optimizer, scheduler


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> float:
    ids = torch.randint(0, VOCAB, (2, 12))  # drawn from the global RNG, so resume must restore it
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return loss.item()


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _draw_all_rngs() -> tuple[Any, ...]:
    return torch.rand(3), random.random(), np.random.rand(2)


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


# ------------------------------------------------------------------------------------------------ round trips


def test_resume_restores_weights_optimizer_scheduler_and_rng_exactly(tmp_path: Path) -> None:
    model = _model(0)
    optimizer, scheduler = _trainer(model)
    for _ in range(2):
        _train_step(model, optimizer, scheduler)
    random.seed(5)
    np.random.seed(5)
    state = {"step": 2, "epoch": 0, "data": {"cursor": 24, "order": [3, 1, 2]}}
    path = save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, lr_scheduler=scheduler, train_state=state)
    expected_loss = _train_step(model, optimizer, scheduler)  # the uninterrupted run's step 3
    expected_draws = _draw_all_rngs()

    fresh = _model(1)
    fresh_optimizer, fresh_scheduler = _trainer(fresh)
    assert not _same_tensors(fresh.state_dict(), model.state_dict())
    _draw_all_rngs()  # move every generator elsewhere
    restored = load_checkpoint(path, model=fresh, optimizer=fresh_optimizer, lr_scheduler=fresh_scheduler)

    assert restored == state
    assert fresh_scheduler.last_epoch == 2 and fresh_scheduler.get_last_lr() == pytest.approx([1e-2 / 3])
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 2
    # Continuing gives the same step-3 loss (its batch comes from the restored torch RNG) and the same weights...
    assert _train_step(fresh, fresh_optimizer, fresh_scheduler) == expected_loss
    assert _same_tensors(fresh.state_dict(), model.state_dict())
    # ... and every generator goes on with the same numbers.
    draws = _draw_all_rngs()
    assert torch.equal(draws[0], expected_draws[0]) and draws[1] == expected_draws[1]
    assert np.array_equal(draws[2], expected_draws[2])


def test_saved_model_reloads_in_transformers_with_identical_logits(tmp_path: Path) -> None:
    model = _model(0).eval()
    path = save_checkpoint(tmp_path, 7, model=model, train_state={"step": 7}, tokenizer=_tokenizer())
    reloaded = AutoModelForCausalLM.from_pretrained(path / "model")
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert json.loads((path / "model" / "config.json").read_text())["use_cache"] is True  # an inference export
    assert model.config.use_cache is False  # the training model keeps its own setting
    assert AutoTokenizer.from_pretrained(path / "model")("hello world")["input_ids"] == [1, 2]
    assert sorted(p.name for p in path.iterdir()) == [
        COMPLETE_MARKER, "model", "rng_state.pt", "train_state.json"]


def test_moe_experts_saved_in_the_original_layout_resume_exactly(tmp_path: Path) -> None:
    config = {"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
              "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "vocab_size": VOCAB}
    model = _model(0, config)
    path = save_checkpoint(tmp_path, 1, model=model, train_state={})
    fresh = _model(1, config)
    load_checkpoint(path, model=fresh)
    assert _same_tensors(fresh.state_dict(), model.state_dict())


def test_lora_checkpoint_exports_a_merged_model_and_resumes_the_adapter(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(_model(0), lora)
    optimizer, scheduler = _trainer(model)
    _train_step(model, optimizer, scheduler)  # makes lora_B non-zero
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, lr_scheduler=scheduler,
                           train_state={"step": 1})

    assert _same_tensors(model.state_dict(), before)  # merging happened on a copy
    assert not any(layer.merged for layer in model.modules() if hasattr(layer, "merged"))
    assert (path / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(path / "model")
    ids = torch.randint(0, VOCAB, (2, 9))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)

    fresh = get_peft_model(_model(0), lora)  # same base weights (same seed), new adapter
    fresh_optimizer, fresh_scheduler = _trainer(fresh)
    assert not _same_tensors(fresh.state_dict(), before)
    load_checkpoint(path, model=fresh, optimizer=fresh_optimizer, lr_scheduler=fresh_scheduler)
    assert _same_tensors(fresh.state_dict(), before)


# ------------------------------------------------------------------------------------------------ atomicity


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_crash_while_writing_keeps_latest_on_the_previous_checkpoint(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(0)
    optimizer, scheduler = _trainer(model)
    first = save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, train_state={"step": 1})

    real_save = torch.save

    def failing_save(obj: Any, file: Any, *args: Any, **kwargs: Any) -> None:
        if str(file).endswith("optimizer.pt"):
            real_save(obj, file, *args, **kwargs)
            raise OSError("disk full")
        real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(single_file_state.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, train_state={"step": 2})
    monkeypatch.undo()

    assert (tmp_path / "latest").read_text() == "step_1\n"
    assert find_latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]  # the temp dir was removed


def test_leftovers_of_killed_saves_are_ignored_then_cleaned(tmp_path: Path) -> None:
    model = _model(0)
    first = save_checkpoint(tmp_path, 1, model=model, train_state={"step": 1})
    # A process killed after writing everything but before the rename: complete contents, temporary name.
    leftover = tmp_path / f".tmp-step_3-{_dead_pid()}"
    leftover.mkdir()
    for file in first.rglob("*"):
        target = leftover / file.relative_to(first)
        target.mkdir(exist_ok=True) if file.is_dir() else target.write_bytes(file.read_bytes())
    # A step directory without its marker, and one whose weights were truncated after the marker was written.
    (tmp_path / "step_4").mkdir()
    truncated = tmp_path / "step_5"
    truncated.mkdir()
    for file in first.rglob("*"):
        target = truncated / file.relative_to(first)
        target.mkdir(exist_ok=True) if file.is_dir() else target.write_bytes(file.read_bytes())
    marker = json.loads((truncated / COMPLETE_MARKER).read_text())
    (truncated / COMPLETE_MARKER).write_text(json.dumps({**marker, "step": 5}))
    (truncated / "model" / "model.safetensors").write_bytes(b"\0" * 10)

    assert is_complete_checkpoint(first) and not is_complete_checkpoint(truncated)
    assert find_latest_checkpoint(tmp_path) == first
    assert list_checkpoints(tmp_path) == [first]
    with pytest.raises(ConfigError, match=r"step_4' is not a complete checkpoint"):
        load_checkpoint(tmp_path / "step_4", model=model)

    save_checkpoint(tmp_path, 2, model=model, train_state={"step": 2}, keep_last=None)
    assert not leftover.exists()  # its process is gone: the next save removes it
    assert (tmp_path / "step_4").exists() and truncated.exists()  # incomplete step dirs are left for the user


def test_stale_latest_pointer_falls_back_to_the_newest_complete_checkpoint(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    model = _model(0)
    save_checkpoint(tmp_path, 1, model=model, train_state={}, keep_last=None)
    second = save_checkpoint(tmp_path, 2, model=model, train_state={}, keep_last=None)
    (tmp_path / "latest").write_text("step_9\n")
    assert find_latest_checkpoint(tmp_path) == second
    assert "names 'step_9', which is missing or incomplete; using step_2" in caplog.text
    assert find_latest_checkpoint(tmp_path / "nowhere") is None


def test_latest_pointer_wins_over_a_higher_step(tmp_path: Path) -> None:
    model = _model(0)
    save_checkpoint(tmp_path, 9, model=model, train_state={}, keep_last=None)
    resumed_earlier = save_checkpoint(tmp_path, 3, model=model, train_state={}, keep_last=None)
    assert find_latest_checkpoint(tmp_path) == resumed_earlier
    assert load_checkpoint(tmp_path, model=model) == {}  # a root resolves to its latest checkpoint


# ------------------------------------------------------------------------------------------------ pruning, errors


def test_keep_last_prunes_the_oldest_complete_checkpoints(tmp_path: Path) -> None:
    model = _model(0)
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, model=model, train_state={"step": step}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4"]
    save_checkpoint(tmp_path, 5, model=model, train_state={"step": 5}, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_5"]


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    model = _model(0)
    save_checkpoint(tmp_path, 4, model=model, train_state={"version": 1})
    path = save_checkpoint(tmp_path, 4, model=model, train_state={"version": 2})
    assert load_checkpoint(path, model=model) == {"version": 2}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"keep_last": 0}, r"^keep_last: must be a positive integer or None \(keep all\); got 0\."),
    ({"step": -1}, r"^step: must be a non-negative integer; got -1\."),
])
def test_bad_save_arguments(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    arguments: dict[str, Any] = {"step": 1, "keep_last": 2, **kwargs}
    with pytest.raises(ConfigError, match=message):
        save_checkpoint(tmp_path, arguments.pop("step"), model=_model(0), train_state={}, **arguments)


def test_non_json_train_state_fails_before_anything_is_published(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="train_state must hold JSON types only"):
        save_checkpoint(tmp_path, 1, model=_model(0), train_state={"tensor": torch.zeros(1)})
    assert list(tmp_path.iterdir()) == []


def test_loading_into_a_different_kind_of_model_or_optimizer_is_refused(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    model = _model(0)
    path = save_checkpoint(tmp_path, 1, model=model, train_state={})
    peft_model = get_peft_model(_model(0), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ConfigError, match="holds full model weights but a peft model was given"):
        load_checkpoint(path, model=peft_model)
    optimizer, _ = _trainer(model)
    with pytest.raises(ConfigError, match="has no optimizer.pt, so the optimizer state cannot be restored"):
        load_checkpoint(path, model=model, optimizer=optimizer)
    shallower = _model(0, {**LLAMA, "num_hidden_layers": 1})
    with pytest.raises(ConfigError, match=r"do not fit the model: missing \[\], unexpected \['model\.layers\.1\."):
        load_checkpoint(path, model=shallower)
    narrower = _model(0, {**LLAMA, "intermediate_size": 32})
    with pytest.raises(ConfigError, match=r"do not fit the model \(saved vs model shape\): "
                                          r"model\.layers\.0\.mlp\.down_proj\.weight \[32, 64\] vs \[32, 32\]"):
        load_checkpoint(path, model=narrower)
    assert torch.equal(narrower.model.layers[0].mlp.down_proj.weight, _model(0, {**LLAMA, "intermediate_size": 32})
                       .model.layers[0].mlp.down_proj.weight)  # nothing was half-copied


def test_checkpoint_files_are_listed_with_their_sizes_and_hashes(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, model=_model(0), train_state={})
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    assert marker["step"] == 1 and marker["peft"] is False and marker["format"] == 2
    weights = path / "model" / "model.safetensors"
    assert marker["files"]["model/model.safetensors"] == {
        "size": os.path.getsize(weights), "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    assert COMPLETE_MARKER not in marker["files"] and "train_state.json" in marker["files"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # importing torch._dynamo warns about torch.jit
def test_compiled_models_are_saved_and_loaded_through_their_original_module(tmp_path: Path) -> None:
    model = _model(0)
    compiled = torch.compile(model)  # wrapping only: nothing is compiled until it is called
    path = save_checkpoint(tmp_path, 1, model=compiled, train_state={})
    fresh = _model(1)
    load_checkpoint(path, model=torch.compile(fresh))
    assert _same_tensors(fresh.state_dict(), model.state_dict())


def test_the_store_follows_the_strategy_and_the_saved_layout(tmp_path: Path) -> None:
    from remat.distributed import DistributedSetup
    from remat.training_state.stores import ShardedState, SingleFileState, state_store, store_for_saved

    single = DistributedSetup.build(device="cpu")
    assert isinstance(state_store(single), SingleFileState)
    model = _model(0)
    path = state_store(single).save(tmp_path, 3, model=model, optimizer=None, lr_scheduler=None,
                                    train_state={"step": 3}, tokenizer=None, keep_last=None)
    assert path == tmp_path / "step_3" and isinstance(store_for_saved(path, single), SingleFileState)
    assert store_for_saved(path, single).load(path, model=_model(1), optimizer=None, lr_scheduler=None)["step"] == 3
    fsdp2 = DistributedSetup(strategy="fsdp2")  # not joined: only its strategy is read
    assert isinstance(state_store(fsdp2), ShardedState)
    with pytest.raises(ConfigError, match="checkpoint.resume: .* fsdp2 cannot resume"):
        store_for_saved(path, fsdp2)


def test_pruning_keeps_the_newest_checkpoint_that_verifies(tmp_path: Path) -> None:
    from remat.training_state.layout import prune
    from remat.training_state.verify import verify_checkpoint

    model = _model(0)
    for step in (2, 4):
        save_checkpoint(tmp_path, step, model=model, train_state={"step": step}, keep_last=None)
    weights = tmp_path / "step_4" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))  # same size: complete, but does not verify
    assert verify_checkpoint(tmp_path / "step_4") is not None
    # A run that fell back to step_2 saves step_3: that one verifies and survives any keep_last; the newer step_4 is
    # not this line's, so pruning never touches it (a resume moves broken ones aside itself).
    resumed = save_checkpoint(tmp_path, 3, model=model, train_state={"step": 3}, keep_last=1)
    assert verify_checkpoint(resumed) is None
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4"]
    # Asked to keep a checkpoint that is not complete, pruning deletes nothing.
    save_checkpoint(tmp_path, 5, model=model, train_state={"step": 5}, keep_last=None)
    (tmp_path / "step_5" / COMPLETE_MARKER).unlink()
    prune(tmp_path, 1, keep=tmp_path / "step_5")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4"] and (tmp_path / "step_5").is_dir()


def test_rng_state_loads_with_weights_only(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 1, model=_model(0), train_state={})
    state = torch.load(path / "rng_state.pt", weights_only=True)
    assert set(state) >= {"torch", "python", "numpy"}
    sources = [p.read_text() for p in Path(single_file_state.__file__).parent.glob("*.py")]
    assert all("weights_only=False" not in text for text in sources)
