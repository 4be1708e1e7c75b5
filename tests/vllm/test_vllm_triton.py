"""The Triton route end to end through vLLM on this CPU: ``EMBEDQ_SERVE_KERNEL=triton`` with
``TRITON_INTERPRET=1`` makes the prepared table of a tied model use the Triton kernels on CPU
tensors; vLLM's loader, ``embed_input_ids`` and ``compute_logits`` (through EmbedqMethod)
then run them, for float32 and float16 models, one tiny tied model per scheme.

``TRITON_INTERPRET`` is read when embedq's kernels are first decorated (lazily, at the
first call), so setting it here is enough as long as no earlier test in this process ran
them compiled (none does on a CPU machine).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from _harness import assert_logits_match, init_single_process, magnitude, prepared, reference, vocab_layers

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed in this vLLM environment")

SCHEMES = {
    "q8": dict(bits=8),
    "q8asym_g32": dict(bits=8, group_size=32, symmetric=False),
    "q4g32": dict(bits=4),
    "q4asym_g64": dict(bits=4, group_size=64, symmetric=False),
}


def _load(model_dir, dtype: str):
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    vc = EngineArgs(model=str(model_dir), dtype=dtype, enforce_eager=True, max_model_len=128,
                    max_num_seqs=4).create_engine_config()
    with set_current_vllm_config(vc):
        init_single_process()
        model = get_model(vllm_config=vc)
    return vc, model


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_tied_model_served_by_triton_kernels(builder, monkeypatch, scheme, dtype):
    from embedq.kernels import triton_head
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    for name in ("logits", "gather"):
        real = getattr(triton_head, name)
        monkeypatch.setattr(triton_head, name,
                            lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    d = builder.quantized("qwen2", scheme, **SCHEMES[scheme])
    vc, model = _load(d, dtype)
    dt = getattr(torch, dtype)
    assert vc.model_config.dtype == dt
    embed, head = vocab_layers(model)
    p = prepared(embed)
    assert p.kind == "triton" and prepared(head) is p  # one table, read by both kernels
    # the stored layout as is: packed codes + scales (+ int8 zero points), nothing else
    rows, cols = embed.num_embeddings_per_partition, p.cols
    scale_bytes = p.layout.scale.numel() * p.layout.scale.element_size()
    zp_bytes = 0 if p.layout.zp is None else p.layout.zp.numel()
    assert p.nbytes == rows * cols * p.bits // 8 + scale_bytes + zp_bytes

    ref = reference(d, "model.embed_tokens", dt)
    vocab = ref.shape[0]
    ids = torch.tensor([0, vocab - 1, 3, 3, 250, 499])
    got = model.embed_input_ids(ids)
    assert got.dtype == dt and torch.equal(got, ref[ids])
    assert calls == ["gather"]

    h = torch.randn(5, cols, generator=torch.Generator().manual_seed(2)).to(dt)
    logits = model.compute_logits(h)
    assert logits.shape == (5, vocab) and calls == ["gather", "logits"]
    ref32 = reference(d, "model.embed_tokens", torch.float32)
    want = (h.float() @ ref32.t()).to(dt)
    assert_logits_match(logits, want, h, magnitude(d, "model.embed_tokens"))
