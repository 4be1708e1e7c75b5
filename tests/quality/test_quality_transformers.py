"""transformers back end: quantized modules, equality with a dequantized reference, memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import embedq
from embedq.backends.transformers import (PackedTable, QuantizedEmbedding, QuantizedLMHead,
                                          quantized_modules, quantized_nbytes)
from embedq.errors import OverlayError
from embedq.format.codec import QuantizedTable
from embedq.format.scheme import Scheme
from embedq.quant.rtn import quantize_rtn
from qualutil import (assert_logits_match, assert_model_logits_match, assert_same_greedy,
                      dequantized_reference, overlay_tensor_bytes)

IDS = torch.tensor([[1, 5, 7, 9, 11, 200, 3, 4, 5, 6, 7, 8, 9, 10, 250, 2]])

CASES = [
    ("qwen2_tied", dict(bits=8)),
    ("qwen2_tied", dict(bits=4, head_bits=8)),  # Q4 gather + int8 head table (recorded untie)
    ("gemma3_tied", dict(bits=4, symmetric=False)),  # Gemma's embed scale
    ("gemma3_tied", dict(bits=8, group_size=32)),
    ("llama_untied_sharded", dict(bits=8, lm_head=True, symmetric=False, group_size=32)),
    ("llama_untied_sharded", dict(bits=4, lm_head=True, output=True)),  # derived: no float table
    ("llama_untied_fp32", dict(bits=8)),  # head stays float
    ("llava_nested", dict(bits=8)),  # checkpoint layout differs from the module tree
]


def _model_class(path):
    cfg = transformers.AutoConfig.from_pretrained(path)
    if type(cfg) in transformers.AutoModelForCausalLM._model_mapping:
        return transformers.AutoModelForCausalLM
    return transformers.AutoModelForImageTextToText


@pytest.mark.parametrize("kind,kw", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_loaded_logits_equal_dequantized_reference(model_factory, tmp_path, kind, kw):
    src = model_factory(kind)
    kw = dict(kw)
    out = tmp_path / "derived" if kw.pop("output", False) else None
    embedq.quantize(src, progress=False, output=out, **kw)
    path = out or src
    model = embedq.load(path)
    mods = quantized_modules(model)
    assert any(isinstance(m, QuantizedEmbedding) for m in mods.values())
    qc = embedq.load_overlay(path).config
    if qc["aliases"]:  # a tied head reads the embedding's table: one table in memory
        emb = next(m for m in mods.values() if isinstance(m, QuantizedEmbedding))
        head = next(m for m in mods.values() if isinstance(m, QuantizedLMHead))
        assert head.table is emb.table
    if kw.get("head_bits"):
        assert len({id(m.table) for m in mods.values()}) == 2
    # the quantized modules hold no float weight (only the packed buffers)
    assert all(list(m.parameters()) == [] for m in mods.values())
    if not qc["aliases"] and not kw.get("lm_head") and not kw.get("head_bits"):
        assert not isinstance(model.get_output_embeddings(), QuantizedLMHead)  # untied head stays float
    # memory of the quantized modules: the quantized size (the serving layout of 4-bit adds
    # its kernel's zeros and rows padded to 64; zero points are one byte per group)
    assert overlay_tensor_bytes(path) * 0.99 <= quantized_nbytes(model) <= overlay_tensor_bytes(path) * 1.3

    ref = dequantized_reference(src, path, type(model), dtype=model.dtype)
    assert_model_logits_match(model, ref, IDS)
    assert_same_greedy(model, ref, IDS, 6)


def test_dtype_follows_the_model(model_factory):
    src = model_factory("gemma3_tied")
    embedq.quantize(src, bits=8, progress=False)
    m = embedq.load(src, dtype=torch.float32)
    assert m.model.embed_tokens(IDS).dtype == torch.float32
    ref = dequantized_reference(src, src, type(m), dtype=torch.float32)
    assert_model_logits_match(m, ref, IDS)
    m.to(torch.bfloat16)
    assert m.model.embed_tokens(IDS).dtype == torch.bfloat16


def test_head_chunks_match_one_matmul(model_factory, monkeypatch):
    """The one chunked reference (``EMBEDQ_FASTPATH=0``: embedq.kernels' chunked layout)
    serves the loaded head in bounded chunks of rows that together equal one matmul."""
    from embedq.kernels import layouts as kernel_layouts
    src = model_factory("llama_untied_sharded")
    embedq.quantize(src, bits=4, lm_head=True, progress=False)
    monkeypatch.setenv("EMBEDQ_FASTPATH", "0")
    m = embedq.load(src)
    head = m.lm_head
    assert head.table.prepared.kind == "chunked"
    h = torch.randn(2, 5, head.in_features).to(m.dtype)
    w = head.table.prepared.dequantize_range(0, head.out_features, h.dtype)
    full = torch.nn.functional.linear(h, w)
    # 64-row chunks (the reference's row alignment): 1000 rows are 16 chunks, the last partial;
    # no chunk's dequantized rows exceed that bound
    monkeypatch.setattr(kernel_layouts, "CHUNK_ELEMS", 64 * head.in_features)
    seen = []
    real = kernel_layouts.dequantize_range
    monkeypatch.setattr(kernel_layouts, "dequantize_range",
                        lambda lay, a, b, dt: seen.append(b - a) or real(lay, a, b, dt))
    with torch.no_grad():
        assert_logits_match(head(h), full, h, w)
        assert seen == [64] * 15 + [1000 - 15 * 64]
        # float32 activations: the chunked reference is bit-equal to one matmul
        w32 = head.table.prepared.dequantize_range(0, head.out_features, torch.float32)
        assert torch.equal(head(h.float()), torch.nn.functional.linear(h.float(), w32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [None, 16])
def test_packed_zero_points_gathered_per_row(bits, group):
    torch.manual_seed(bits)
    rows, cols = 37, 64  # rows not a multiple of the zero points per int32 word
    x = torch.randn(rows, cols) * torch.rand(rows, 1) + torch.rand(rows, 1)
    s = Scheme(bits=bits, symmetric=False, group_size=group)
    q, scale, zp = quantize_rtn(x, s, torch.bfloat16)
    t = QuantizedTable.from_codes(q, scale, zp, bits, group)
    pt = PackedTable(rows, cols, bits, group, False, torch.bfloat16, device="cpu")
    pt.load_from(t.packed, t.scale, torch.tensor([rows, cols]), t.packed_zero_point())
    ids = torch.tensor([0, 36, 5, 5, 8, 31, 32, 1])
    assert torch.equal(pt.dequantize_rows(ids, torch.float32), t.dequantize(torch.float32, ids))
    assert torch.equal(pt.dequantize(torch.float32, 3, 30), t.dequantize(torch.float32, slice(3, 30)))
    assert pt.nbytes() == t.nbytes()


def test_load_without_overlay_is_a_clear_error(model_factory):
    src = model_factory("qwen2_tied")
    with pytest.raises(OverlayError, match=str(src)):
        embedq.load(src)


def test_auto_model_after_import_embedq_any_order(model_factory, tmp_path):
    src = model_factory("qwen2_tied")
    out = tmp_path / "derived"
    embedq.quantize(src, bits=8, output=out, progress=False)
    code = textwrap.dedent(f"""
        import sys
        {{first}}
        {{second}}
        from transformers import AutoModelForCausalLM
        m = AutoModelForCausalLM.from_pretrained({str(out)!r})
        print(type(m.model.embed_tokens).__name__, type(m.lm_head).__name__)
        print(m.generate(__import__("torch").tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False).shape)
    """)
    for first, second in (("import embedq", "import transformers"),
                          ("import transformers.modeling_utils", "import embedq")):
        r = subprocess.run([sys.executable, "-c", code.format(first=first, second=second)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "QuantizedEmbedding QuantizedLMHead" in r.stdout
        assert "torch.Size([1, 6])" in r.stdout


@pytest.mark.parametrize("bits,group", [(8, None), (8, 32), (4, 32), (4, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_fast_path_is_bit_identical(bits, group, dtype):
    g = torch.Generator().manual_seed(bits)
    rows, cols = 300, 64
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (rows, cols), generator=g, dtype=torch.int8)
    q[0, :2] = torch.tensor([lo, hi], dtype=torch.int8)
    groups = 1 if group is None else cols // group
    exp = torch.randint(-20, 4, (rows, groups), generator=g).float()
    scale = (torch.rand(rows, groups, generator=g) * 2.0 ** exp).to(dtype)
    t = QuantizedTable.from_codes(q, scale, None, bits, group)
    pt = PackedTable(rows, cols, bits, group, True, dtype, device="cpu")
    pt.load_from(t.packed, t.scale, torch.tensor([rows, cols]), None)
    assert torch.equal(pt.dequantize(dtype), t.dequantize(dtype))
    ids = torch.tensor([0, 299, 7, 7])
    assert torch.equal(pt.dequantize_rows(ids, dtype), t.dequantize(dtype, ids))
