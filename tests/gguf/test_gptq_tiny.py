"""A gptq table transcodes exactly, both widths, on the tiny untied llama GGUF (embedding
and head): gptq changes which codes a table holds, not how they are stored, so this is the
same check as the real-model one (tests/gguf/test_gemma_gguf.py keeps Gemma at 4 bits,
whose gptq solve over 262,144 rows costs minutes) at the cost of a second."""

from __future__ import annotations

import pytest
import torch

import embedq
from embedq.quant.gptq import Calibration

from ggufutil import assert_transcoded

BOTH = {"token_embd.weight": "model.embed_tokens", "output.weight": "lm_head"}


@pytest.mark.parametrize("bits", [8, 4])
def test_tiny_gptq_exact(tiny, tmp_path, bits):
    hf, base = tiny
    g = torch.Generator().manual_seed(bits)
    h = torch.randn(256, 64, generator=g, dtype=torch.float64)
    ov = tmp_path / "ov"
    embedq.quantize(hf, output=ov, overlay_only=True, lm_head=True, method="gptq", bits=bits, group_size=32,
                    scale_dtype="float16", calibration=Calibration(hessian=h.T @ h / h.shape[0]), progress=False)
    out = embedq.gguf(base, ov, tmp_path / "out.gguf")
    assert any(t.scheme.endswith("gptq") for t in out.tables), [t.scheme for t in out.tables]
    assert_transcoded(base, tmp_path / "out.gguf", ov, BOTH)
