"""Document-wise attention (`remat.models.document_attention`): packed rows give transformers' dense-mask outputs and
gradients on every architecture of the gradient tests, under checkpointing too, without any [T, T] tensor, reading
the document boundaries once per step."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import pytest
import torch
from ckpt_models import (
    ARCHS,
    BATCH,
    SEQ,
    VOCAB,
    assert_same_grads,
    batch,
    tiny_model,
)
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from remat.auto import AutoModelForCausalLM
from remat.checkpointing import apply_activation_checkpointing
from remat.errors import ConfigError
from remat.memory import LiveTensorTracker
from remat.models import ModelConfig, document_attention
from remat.models.document_attention import (
    SDPA_NAME,
    documents_of,
    use_document_attention,
)

# Row 0: documents of 4, 6 and 6 tokens. Row 1 starts inside a document (positions 6, 7, 8: the rest of one that
# began in an earlier row), then documents of 10 and 3 tokens.
PACKED = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5],
                       [6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2]])
assert PACKED.shape == (BATCH, SEQ)


def _without_attention_dropout(model: nn.Module) -> nn.Module:
    """Attention dropout draws per document here and once per row in the dense path: switched off to compare."""
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.0
        if isinstance(getattr(module, "attn_dropout", None), nn.Dropout):
            module.attn_dropout.p = 0.0
    return model


def _step(model: nn.Module, ids: torch.Tensor, position_ids: torch.Tensor | None = PACKED,
          **inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)
    out = model(input_ids=ids, labels=ids, position_ids=position_ids, use_cache=False, **inputs)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def _document_model(arch: str) -> nn.Module:
    model = _without_attention_dropout(tiny_model(arch))
    use_document_attention(model, True, packed=True)
    return model


@pytest.mark.parametrize("arch", list(ARCHS))
def test_packed_outputs_and_gradients_equal_the_dense_mask(arch: str) -> None:
    ids = batch()
    dense = _without_attention_dropout(tiny_model(arch))
    expected_logits, expected = _step(dense, ids)
    model = _document_model(arch)
    assert model.config._attn_implementation.startswith("remat_document_")
    logits, grads = _step(model, ids)
    torch.testing.assert_close(logits, expected_logits)
    assert expected.keys() == grads.keys()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], msg=lambda m, n=name: f"{n}: {m}")
    one_document, _ = _step(dense, ids, position_ids=None)  # the documents really are kept apart
    assert (one_document - expected_logits).abs().max() > 1e-3


def _windowed(arch: str, attn_implementation: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"head_dim": 8} if arch == "gemma2" else {}
    config = AutoConfig.for_model(arch, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                  max_position_embeddings=64, sliding_window=3, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).train()


@pytest.mark.parametrize(("arch", "attn_implementation"), [("mistral", "sdpa"), ("mistral", "eager"),
                                                          ("gemma2", "eager")])
def test_sliding_windows_shorter_than_the_documents(arch: str, attn_implementation: str) -> None:
    ids = batch()
    expected_logits, expected = _step(_windowed(arch, attn_implementation), ids)
    model = _windowed(arch, attn_implementation)
    use_document_attention(model, "auto", packed=True)
    logits, grads = _step(model, ids)
    torch.testing.assert_close(logits, expected_logits)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], msg=lambda m, n=name: f"{n}: {m}")


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the boundary reads, each of which must run outside every checkpointed region: selective
    checkpointing's dispatch modes would see its ops in a layer's forward but not in that layer's recompute (which
    finds the boundaries cached), and its per-op replay would shift (see the NOTE in document_attention.py)."""
    calls = [0]
    compute = document_attention._compute_documents

    def counted(position_ids: torch.Tensor) -> Any:
        calls[0] += 1
        modes = _get_current_dispatch_mode_stack()
        assert not modes, f"boundaries read under {modes}: inside a checkpointed region"
        return compute(position_ids)

    monkeypatch.setattr(document_attention, "_compute_documents", counted)
    return calls


@pytest.mark.parametrize("arch", ["llama", "gemma2", "mixtral", "gemma3n_text"])
@pytest.mark.parametrize("policy", ["full", "selective", "offload"])
def test_checkpointed_gradients_equal_the_uncheckpointed_run_and_boundaries_are_read_once(
        arch: str, policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = batch()
    reference = tiny_model(arch)  # attention dropout on: the recompute replays the per-document draws
    use_document_attention(reference, True, packed=True)
    _, expected = _step(reference, ids, position_ids=PACKED.clone())
    model = tiny_model(arch)
    use_document_attention(model, True, packed=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        apply_activation_checkpointing(model, policy)
    calls = _counting(monkeypatch)
    _, grads = _step(model, ids, position_ids=PACKED.clone())
    assert_same_grads(expected, grads)
    assert calls[0] == 1  # every layer, forward and recompute, used the boundaries read once
    _step(model, ids, position_ids=PACKED.clone())
    assert calls[0] == 2  # a new step's position_ids are read again
    _step(model, ids, position_ids=None)
    assert calls[0] == 3  # the decoder's own positions, passed to its layers, are read before the layers too


def _one_layer_llama() -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=32,
                                  max_position_embeddings=4096)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()


def _tracked(model: nn.Module, length: int) -> tuple[int, int]:
    """(tracked peak, largest single allocation) of a packed step of one row of 64-token documents."""
    ids = torch.randint(0, 32, (1, length), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(length)[None] % 64
    largest = [0]

    def listener(event: str, serial: int, nbytes: int, category: str) -> None:
        if event == "alloc":
            largest[0] = max(largest[0], nbytes)

    with LiveTensorTracker(listener=listener) as tracker:
        model(input_ids=ids, labels=ids, position_ids=position_ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    return tracker.peak_bytes, largest[0]


def test_the_tracked_peak_grows_linearly_without_a_tokens_squared_tensor() -> None:
    short, long = 1024, 2048
    dense = _one_layer_llama()
    dense_short, dense_largest = _tracked(dense, short)
    dense_long, _ = _tracked(dense, long)
    assert dense_largest >= short * short  # transformers' [1, 1, T, T] mask: the measure sees it
    assert dense_long > 2 * dense_short  # ... and its square growth
    model = _one_layer_llama()
    use_document_attention(model, "auto", packed=True)
    peak_short, largest = _tracked(model, short)
    peak_long, _ = _tracked(model, long)
    assert largest < short * short / 4  # the largest is the logits, [T, vocab] fp32
    assert peak_long <= 2 * peak_short  # a + b T with a >= 0: linear in T
    assert peak_long < dense_long / 2


def test_fake_or_missing_position_ids_mean_one_document_per_row() -> None:
    assert documents_of(None, 2, 16) is None
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(PACKED)
        assert documents_of(fake, 2, 16) is None
    assert documents_of(torch.arange(16)[None], 2, 16) is None  # no restart: one document
    documents = documents_of(PACKED, 2, 16)
    assert documents is not None and documents.rows == ((0, 4, 10, 16), (0, 3, 13, 16))
    with pytest.raises(Exception, match=r"position_ids of shape \(3, 16\)"):
        documents_of(torch.zeros(3, 16, dtype=torch.long), 2, 16)


def test_right_padding_is_exact_and_other_padding_is_refused() -> None:
    """Right padding changes no real token's output; transformers, given any 2-D mask, stops separating the packed
    documents (it looks for packing only without a mask), so the reference is the dense path without the mask."""
    ids = batch()
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 13:] = 0  # right padding: its tokens' outputs are not compared (labels -100 in training)
    dense = _without_attention_dropout(tiny_model("llama"))
    expected = dense(input_ids=ids, position_ids=PACKED, use_cache=False).logits
    model = _document_model("llama")
    logits = model(input_ids=ids, position_ids=PACKED, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(logits[mask.bool()], expected[mask.bool()])
    left = mask.flip(-1)
    with pytest.raises(ConfigError, match="model.document_attention: an attention_mask with left padding"):
        model(input_ids=ids, position_ids=PACKED, attention_mask=left, use_cache=False)


def test_settings_and_the_line_that_says_which_attention_runs(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="remat.models.document_attention"):
        line = use_document_attention(tiny_model("llama"), "auto", packed=True)
    assert line.startswith(f"attention: {SDPA_NAME} (sdpa per document, packed rows: no [tokens, tokens] mask")
    assert line in caplog.text
    unpacked = tiny_model("llama")
    assert "rows are not packed" in use_document_attention(unpacked, "auto", packed=False)
    assert unpacked.config._attn_implementation == "sdpa"
    off = tiny_model("llama")
    assert "model.document_attention is false" in use_document_attention(off, False, packed=True)
    assert off.config._attn_implementation == "sdpa"
    other = tiny_model("llama")
    other.config._attn_implementation = "flex_attention"
    assert "wraps only sdpa and eager" in use_document_attention(other, "auto", packed=True)
    with pytest.raises(ConfigError, match="model.document_attention: true needs the sdpa or eager"):
        use_document_attention(other, True, packed=True)
    with pytest.raises(ConfigError, match="model.document_attention: must be auto, true or false; got 'yes'"):
        AutoModelForCausalLM.from_pretrained("tiny-llama", document_attention="yes")
    assert ModelConfig(preset="tiny-llama").document_attention == "auto"


def test_recipes_and_the_python_entry_point_use_it_for_packed_rows(tmp_path: Any) -> None:
    from remat.recipes.build import build_recipe_model
    from remat.recipes.loader import validate_recipe

    def recipe(**dataset: Any) -> Any:
        return validate_recipe({"output_dir": str(tmp_path), "model": {"preset": "tiny-llama"},
                                "dataset": {"seq_length": 64, **dataset}})

    assert build_recipe_model(recipe(), vocab_size=512).config._attn_implementation == SDPA_NAME  # packing: true
    assert build_recipe_model(recipe(packing=False), vocab_size=512).config._attn_implementation == "sdpa"
    off = recipe()
    off.model.document_attention = False
    assert build_recipe_model(off, vocab_size=512).config._attn_implementation == "sdpa"
    assert AutoModelForCausalLM.from_pretrained("tiny-llama").config._attn_implementation == SDPA_NAME
    dense = AutoModelForCausalLM.from_pretrained("tiny-llama", document_attention=False)
    assert dense.config._attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="model.document_attention: must be auto, true or false; got 'yes'"):
        validate_recipe({"output_dir": str(tmp_path), "model": {"preset": "tiny-llama", "document_attention": "yes"}})


def test_per_document_sdpa_calls_on_cuda_leave_cudnn_attention_out_and_keep_the_users_other_choices() -> None:
    """NOTE [ No cuDNN attention per document ]: cuDNN builds a plan per new document length (2.6 s steps instead of
    0.45 s on an H100); inside the per-document calls on CUDA it is off, flash / efficient / math as the user set them,
    and everything is as before afterwards. On the CPU and for eager nothing changes."""
    from remat.models.document_attention import _without_cudnn_attention

    cuda = torch.backends.cuda
    flags = (cuda.cudnn_sdp_enabled, cuda.flash_sdp_enabled, cuda.mem_efficient_sdp_enabled, cuda.math_sdp_enabled)
    before = [flag() for flag in flags]
    try:
        cuda.enable_cudnn_sdp(True)
        cuda.enable_flash_sdp(False)  # the user's own choice, kept
        with _without_cudnn_attention(torch.device("cuda"), eager=False):
            assert [flag() for flag in flags] == [False, False, True, True]
        assert [flag() for flag in flags] == [True, False, True, True]
        for device, eager in ((torch.device("cpu"), False), (torch.device("cuda"), True)):
            with _without_cudnn_attention(device, eager):
                assert cuda.cudnn_sdp_enabled()
    finally:
        for enable, on in zip((cuda.enable_cudnn_sdp, cuda.enable_flash_sdp, cuda.enable_mem_efficient_sdp,
                               cuda.enable_math_sdp), before, strict=True):
            enable(on)


def test_compiled_checkpointed_blocks_trace_whole_on_rows_of_one_document_and_stay_exact_on_packed_rows() -> None:
    """NOTE [ Document attention under torch.compile ]: rows of one document each need no boundaries, so a compiled
    block with its checkpoint is one graph (no break, which inside the checkpoint would make the block run
    eagerly); a packed batch afterwards recompiles, breaks the graph as before, and keeps the eager gradients."""
    from remat.checkpointing import CheckpointPolicy
    from remat.recipes.build import compile_blocks

    torch._dynamo.reset()
    graphs: list[str] = []

    def backend(graph: torch.fx.GraphModule, _inputs: Any) -> Any:
        graphs.append(str(graph.graph))
        return graph.forward

    ids = batch()
    reference = _document_model("llama")
    _, expected = _step(reference, ids, position_ids=PACKED.clone())
    model = _document_model("llama")
    apply_activation_checkpointing(model, CheckpointPolicy(mode="full"))
    compile_blocks(model, CheckpointPolicy(mode="full"), backend=backend)
    torch._dynamo.utils.counters.clear()
    _step(model, ids, position_ids=torch.arange(SEQ).expand(BATCH, -1))
    assert len(graphs) == 1 and "checkpoint" in graphs[0]  # one graph for every block, the checkpoint in it
    assert not torch._dynamo.utils.counters["graph_break"]
    _, grads = _step(model, ids, position_ids=PACKED.clone())
    assert_same_grads(expected, grads)
    torch._dynamo.reset()
