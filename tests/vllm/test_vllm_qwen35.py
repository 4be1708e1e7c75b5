"""The founding case, in vLLM 0.33's own model classes on CPU: a Qwen3.5 hybrid (Gated
DeltaNet + full attention) with an embedq table, as text (Qwen3_5ForCausalLM, tied), VL
(Qwen3_5ForConditionalGeneration, untied head quantized too) and VL + its MTP drafter
(Qwen3_5MTP built by vLLM's EagleProposer, which shares the target's quantized embedding
and head); int8 and Q4 g32. A skip of any of these fails the suite (_founding.py)."""

from __future__ import annotations

import pytest
import torch

from _harness import (assert_logits_match, engine_config, init_single_process, load_model, magnitude,
                      prepared, reference, vocab_layers)

import _ev as ev

ev.register()
pytestmark = pytest.mark.founding

SCHEMES = {"int8": dict(bits=8), "q4g32": dict(bits=4)}
KINDS = {  # kind: (embedding module, head module or None when tied)
    "qwen35_text": ("model.embed_tokens", None),
    "qwen35_vl": ("model.language_model.embed_tokens", "lm_head"),
    "qwen35_vl_mtp": ("model.language_model.embed_tokens", "lm_head"),
}


def _quantized(builder, kind, scheme):
    return builder.quantized(kind, scheme, lm_head=KINDS[kind][1] is not None, **SCHEMES[scheme])


def _check_tables(d, model, kind):
    """Embedding rows exactly the overlay's dequantization; logits within the fast path's
    rounding bound of dequantize-then-matmul; no float table held."""
    emb_mod, head_mod = KINDS[kind]
    embed, head = vocab_layers(model)
    assert isinstance(embed.quant_method, ev.EmbedqMethod)
    assert isinstance(head.quant_method, ev.EmbedqMethod)
    ref = reference(d, emb_mod)
    ids = torch.tensor([0, ref.shape[0] - 1, 3, 77, 500])
    torch.testing.assert_close(embed(ids), ref[ids], rtol=0, atol=0)
    torch.testing.assert_close(model.embed_input_ids(ids), ref[ids], rtol=0, atol=0)
    ref_head = ref if head_mod is None else reference(d, head_mod)
    if head_mod is None:
        assert prepared(head) is prepared(embed)  # tied: one serving table
    else:
        assert prepared(head) is not prepared(embed)
    h = torch.randn(4, ref.shape[1], generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    logits = model.compute_logits(h)
    mag = magnitude(d, emb_mod if head_mod is None else head_mod)
    assert_logits_match(logits[:, : ref_head.shape[0]], torch.nn.functional.linear(h, ref_head), h, mag)
    assert embed.weight.numel() == 0 and head.weight.numel() == 0
    return embed, head, h, logits


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("kind", ["qwen35_text", "qwen35_vl"])
def test_qwen35_serves_quantized(builder, kind, scheme):
    d = _quantized(builder, kind, scheme)
    vc, model = load_model(d)
    assert vc.model_config.quantization == "embedq"
    assert type(model).__name__ == ("Qwen3_5ForCausalLM" if kind == "qwen35_text"
                                    else "Qwen3_5ForConditionalGeneration")
    _check_tables(d, model, kind)
    # the hybrid's GDN conv1d weight stays unpacked ([dim, 1, width]) on every CPU
    conv = next(m for n, m in model.named_modules() if n.endswith("linear_attn.conv1d"))
    assert conv.weight.dim() == 3 and conv.weight.shape[1] == 1


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_qwen35_vl_mtp_drafter_shares_the_table(builder, scheme):
    """vLLM's speculative config (method mtp) and EagleProposer.load_model, as the engine's
    model runner calls them: the drafter's embedding and head are the target's embedq layers."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.spec_decode.eagle import EagleProposer
    kind = "qwen35_vl_mtp"
    d = _quantized(builder, kind, scheme)
    vc = engine_config(d, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert vc.speculative_config.draft_model_config.architectures == ["Qwen3_5MTP"]
    with set_current_vllm_config(vc):
        init_single_process()
        target = get_model(vllm_config=vc)
        proposer = EagleProposer(vc, torch.device("cpu"))
        proposer.load_model(target)
    embed, head, h, logits = _check_tables(d, target, kind)
    draft = proposer.model
    assert type(draft).__name__ == "Qwen3_5MTP"
    assert draft.model.embed_tokens is embed and draft.lm_head is head  # one table, shared
    ids = torch.tensor([1, 2, 300])
    torch.testing.assert_close(draft.embed_input_ids(ids), embed(ids), rtol=0, atol=0)
    torch.testing.assert_close(draft.compute_logits(h), logits, rtol=0, atol=0)
