"""The fused loss is exact or refused on every causal LM transformers ships, never silently different.

Every model type of transformers' causal-LM mapping is built from a tiny config (a generic shrink of its defaults;
types whose defaults cannot be shrunk that way, or whose own forward fails on it, are counted, not tested). For each,
`remat.loss.verify_output_head` either passes, and then the fused loss and every gradient equal those of the
model's own loss (its own label convention; the next-token loss of its logits where its forward computes none), or
refuses in one line (ConfigError); any other exception is a failure. A deliberately wrong head, and a model whose own
loss does not shift its labels, are refused."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as hf_logging

from remat.errors import ConfigError
from remat.loss import FusedLinearCrossEntropy, MaskedCrossEntropy, output_head, verify_output_head

#: Sizes every config gets where it has the attribute (a shrink of the defaults, not a model of any one family).
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256, "head_dim": 16,
        "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
        "rotary_dim": 16, "n_group": 1, "topk_group": 1}
MAX_PARAMETERS = 20_000_000
#: Sizes some configs leave None to derive them from others in code that then divides by or raises them (hunyuan's and
#: ministral's ``head_dim``, nemotron's ``num_key_value_heads``): set to the tiny value like the integers.
_DERIVED = ("head_dim", "num_key_value_heads", "moe_intermediate_size")
#: Families whose defaults the generic shrink cannot make run, with the few settings that do (given to
#: ``AutoConfig.for_model`` before the shrink): dbrx's nested configs (and its default ``clip_qkv=None``, which its
#: forward passes to ``clamp`` as both bounds), xmod's language adapters (a default language), reformer's position
#: embeddings (plain ones: axial ones fix the training length), attention chunks, and no randomness: its layers
#: draw their dropout and hashing seeds from ``torch.seed()``, so two forwards differ whatever seed the test sets.
FAMILY_SETTINGS: dict[str, dict[str, object]] = {
    "dbrx": {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 256,
             "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
    "xmod": {"default_language": "en_XX"},
    "reformer": {"attention_head_size": 16, "feed_forward_size": 128, "attn_layers": ["local", "lsh"],
                 "axial_pos_embds": False, "local_attn_chunk_length": 16, "lsh_attn_chunk_length": 16,
                 "num_buckets": 4, "hash_seed": 0, "hidden_dropout_prob": 0.0,
                 "local_attention_probs_dropout_prob": 0.0},
}


def _tiny_model(model_type: str) -> nn.Module | None:
    """The model of `model_type` at a tiny size, or None when the generic shrink does not give one that runs."""
    try:
        config = AutoConfig.for_model(model_type, **FAMILY_SETTINGS.get(model_type, {}))
        for part in {id(c): c for c in (config, config.get_text_config())}.values():
            for key, value in TINY.items():
                current = getattr(part, key, None)
                derived = current is None and key in _DERIVED and hasattr(part, key)  # None: "from other sizes"
                if (isinstance(current, int) and not isinstance(current, bool)) or derived:
                    with contextlib.suppress(AttributeError):  # a read-only property (falcon's head_dim)
                        setattr(part, key, value)
            if hasattr(part, "is_decoder"):
                part.is_decoder = True  # BERT-style models are causal LMs only as decoders
            vocab = getattr(part, "vocab_size", None)
            for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # special ids of the full vocabulary
                if isinstance(vocab, int) and isinstance(getattr(part, key, None), int) and getattr(part, key) >= vocab:
                    setattr(part, key, vocab - 1)
        with torch.device("meta"):
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if size > MAX_PARAMETERS:
            return None
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        with torch.no_grad():
            model(input_ids=torch.arange(8).unsqueeze(0) % 200, use_cache=False)  # its own forward runs
    except Exception:  # noqa: BLE001 (the generic shrink does not fit this family: not a test of remat)
        return None
    return model


def _fused(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    head = output_head(model)
    hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    loss_fn = FusedLinearCrossEntropy(logit_softcap=head.logit_softcap, chunk_size=7)
    return loss_fn(hidden * head.hidden_scale, head.weight, labels, bias=head.bias)


def _own_loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The model's own loss of ``labels`` (its own label convention), or the next-token loss of its logits when its
    forward computes none: what training without remat would optimise."""
    try:
        output = model(input_ids=ids, labels=labels, use_cache=False)
    except TypeError:
        output = None
    if output is not None and isinstance(getattr(output, "loss", None), torch.Tensor):
        return output.loss
    return MaskedCrossEntropy()(model(input_ids=ids, use_cache=False).logits, labels)


@pytest.mark.slow
def test_every_causal_lm_is_exact_or_refused_in_one_line() -> None:
    hf_logging.set_verbosity_error()
    outcomes: dict[str, str] = {}
    failures: list[str] = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = _tiny_model(model_type)
            if model is None:
                outcomes[model_type] = "not built"
                continue
            try:
                verify_output_head(model)
            except ConfigError as err:
                outcomes[model_type] = "refused"
                if "\n" in str(err) or not str(err).startswith("loss_fn: "):
                    failures.append(f"{model_type}: refusal is not one line naming loss_fn: {err}")
                continue
            except Exception as err:  # noqa: BLE001 (collected: a crash is a failure)
                failures.append(f"{model_type}: {type(err).__name__}: {err}")
                continue
            outcomes[model_type] = "exact"
            ids = (torch.arange(12) * 37 % 200).unsqueeze(0)
            labels = ids.masked_fill(torch.arange(12) < 3, -100)
            model.train()  # as in training (some models act otherwise in eval); dropout draws the same masks
            try:
                torch.manual_seed(1)
                plain = _own_loss(model, ids, labels)
                plain.backward()
                expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
                model.zero_grad(set_to_none=True)
                torch.manual_seed(1)
                fused = _fused(model, ids, labels)
                fused.backward()
                torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6)
                for name, param in model.named_parameters():
                    if name in expected:  # within 1e-4 of the gradient's scale (fp32 sums in another order)
                        scale = float(expected[name].abs().max())
                        difference = float((param.grad - expected[name]).abs().max())
                        assert difference <= 1e-4 * scale + 1e-7, f"{name}: {difference:.3g} of {scale:.3g}"
            except AssertionError as err:
                failures.append(f"{model_type}: passed the probe but the loss differs: {str(err)[:300]}")
    assert not failures, "\n".join(failures)
    counts = {kind: sum(v == kind for v in outcomes.values()) for kind in ("exact", "refused", "not built")}
    assert counts["exact"] >= 90 and counts["refused"] >= 10, counts  # the sweep reaches most of the mapping
    for known_wrong in ("bert", "roberta", "camembert", "xlm-roberta", "megatron-bert", "ernie", "data2vec-text",
                        # their own causal-LM loss does not shift the labels (NOTE [ The loss, not only the logits ])
                        "bart", "marian", "mbart", "pegasus", "whisper", "xlnet"):
        assert outcomes.get(known_wrong) in ("refused", "not built"), known_wrong


class _TransformedHead(nn.Module):
    """A model whose logits pass through a transform before the head: what the fused loss cannot know."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def get_decoder(self) -> nn.Module:
        return self.model.get_decoder()

    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> object:
        hidden = self.model.get_decoder()(input_ids=input_ids, **kwargs).last_hidden_state
        out = self.model.get_output_embeddings()(torch.nn.functional.gelu(hidden))
        return type("Out", (), {"logits": out})()


def test_a_deliberately_wrong_head_is_refused() -> None:
    config = AutoConfig.for_model("llama", **{k: TINY[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                                                   "num_attention_heads", "num_key_value_heads")},
                                  num_hidden_layers=1)
    model = AutoModelForCausalLM.from_config(config)
    verify_output_head(model)  # the plain model passes
    with pytest.raises(ConfigError, match=r"computes its logits otherwise than hidden @ lm_head.weight.T .*relative "
                                          r"difference [0-9.e+-]+ on a probe of 8 tokens"):
        verify_output_head(_TransformedHead(model))


def test_a_model_whose_own_loss_does_not_shift_the_labels_is_refused() -> None:
    config = AutoConfig.for_model("bart", d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=256,
                                  max_position_embeddings=64, is_decoder=True)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=r"^loss_fn: BartForCausalLM \(model_type 'bart'\): its own loss does not "
                                          r"shift the labels .*allowed: loss_fn._target_: "
                                          r"remat.loss.MaskedCrossEntropy"):
        verify_output_head(model)
