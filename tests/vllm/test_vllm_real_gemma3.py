"""The real Gemma 3 270M checkpoint (scripts/make_gemma3_fixture.py) served by vLLM's own
Gemma3ForCausalLM through the plugin: tied head through the shared packed table."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from _harness import (REPO, assert_logits_match, dispatch_layout, load_model, magnitude, param_bytes,
                      prepared, reference, vocab_layers)

import embedq
import _ev as ev


ev.register()


def _fixture():
    path = REPO / "scripts" / "make_gemma3_fixture.py"
    spec = importlib.util.spec_from_file_location("make_gemma3_fixture", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ensure_gemma3_270m()


@pytest.fixture(scope="module")
def gemma3_270m():
    return _fixture()


def _inplace_copy(src, dst):
    """Shards hard-linked (embedq never modifies source shards), other files copied."""
    from embedq.format.files import link_checkpoint
    return link_checkpoint(src, dst)


@pytest.mark.parametrize("bits", [8, 4])
def test_real_gemma3_270m(gemma3_270m, tmp_path, bits):
    d = _inplace_copy(gemma3_270m, tmp_path / f"g{bits}")
    embedq.quantize(str(d), bits=bits, progress=False)
    vc, model = load_model(d)
    embed, head = vocab_layers(model)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert head.weight_packed is embed.weight_packed and prepared(head) is prepared(embed)
    ref = reference(d, "model.embed_tokens")
    vocab, hidden = ref.shape
    assert (vocab, hidden) == (262144, 640)
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.tensor([0, 1, 2, vocab - 1]), torch.randint(0, vocab, (124,), generator=g)])
    torch.testing.assert_close(embed(ids), ref[ids], rtol=0, atol=0)
    h = torch.randn(4, hidden, generator=g).to(torch.bfloat16)
    logits = model.compute_logits(h)
    assert logits.shape == (4, vocab)
    cap = model.config.final_logit_softcapping
    expected = torch.nn.functional.linear(h, ref)
    if cap:
        expected = torch.tanh(expected / cap) * cap
    mag = magnitude(d, "model.embed_tokens")
    assert_logits_match(logits, expected, h, mag, softcap=bool(cap))
    exact = h.float() @ ref.float().t()  # the float32 product, rounded once
    if cap:
        exact = torch.tanh(exact / cap) * cap
    assert_logits_match(logits, exact.to(logits.dtype), h, mag, softcap=bool(cap))
    del mag
    # memory: one prepared table (codes + scales as stored; torch's int4 fallback: scale/zero
    # pairs in bf16), the on-disk-layout parameters released, never the 335 MB float table
    p = prepared(embed)
    assert p.kind == dispatch_layout(d, "model.embed_tokens") != "chunked"
    per_row_scales = hidden // (p.group_size or hidden)  # the default scheme's groups
    overlay = vocab * hidden * bits // 8 + vocab * per_row_scales * 2
    assert param_bytes(embed) == 16  # weight_shape only
    assert overlay <= p.nbytes <= overlay * (1.0 if bits == 8 else 1.12)
    assert p.nbytes <= (vocab * hidden * 2) * (0.53 if bits == 8 else 0.32)
    # nothing else in the model holds a vocab-sized float table
    big = [n for n, p in model.named_parameters() if p.is_floating_point() and p.numel() >= vocab * hidden]
    assert not big, big
