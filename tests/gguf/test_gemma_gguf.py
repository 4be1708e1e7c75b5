"""``embedq gguf`` on the real Gemma 3 270M GGUF (token_embd Q8_0 [640, 262144], tied):
gguf-py's dequantization of OUT's token_embd equals embedq's decoding of the overlay bit
for bit, every other tensor and key is BASE's, tied stays tied."""

from __future__ import annotations

import os

import pytest

from ggufutil import FLAGS4, FLAGS8, assert_transcoded, quantize_cli, tensors

pytestmark = pytest.mark.slow
EMB = {"token_embd.weight": "model.embed_tokens"}


@pytest.mark.parametrize("bits,ggml", [(8, "Q8_0"), (4, "Q4_0")])
def test_gemma_rtn_exact(gemma_gguf, gemma_overlays, gemma_outs, bits, ggml):
    out = gemma_outs[bits]
    t = tensors(out)
    assert "output.weight" not in t  # tied stays tied
    assert t["token_embd.weight"].tensor_type.name == ggml
    assert_transcoded(gemma_gguf, out, gemma_overlays[bits], EMB)
    if bits == 4:
        assert os.path.getsize(out) < 0.7 * os.path.getsize(gemma_gguf)


def test_gemma_q4_table_q8_head_exact(gemma_gguf, gemma_overlays, gemma_outs):
    """Tied BASE + an overlay whose head has its own 8-bit table: token_embd Q4_0 and an
    added output.weight Q8_0, both gguf-py-exact; everything else BASE's bytes and keys."""
    out = gemma_outs["4h8"]
    t = tensors(out)
    assert (t["token_embd.weight"].tensor_type.name, t["output.weight"].tensor_type.name) == ("Q4_0", "Q8_0")
    assert_transcoded(gemma_gguf, out, gemma_overlays["4h8"],
                      {**EMB, "output.weight": "lm_head"}, added={"output.weight": "token_embd.weight"})


@pytest.fixture(scope="module")
def small_calibration(gemma3_270m):
    """gptq's statistics from 4 x 64 tokens: what is checked is that OUT keeps a gptq
    table's codes, whatever they are; the default calibration (and its cost) is for quality."""
    from embedq.jobs.calibration import collect_calibration
    return collect_calibration(gemma3_270m, contexts=4, length=64)


@pytest.mark.parametrize("bits", [4])  # 8-bit gptq: tests/gguf/test_gptq_tiny.py (minutes saved)
def test_gemma_gptq_exact(gemma3_270m, gemma_gguf, small_calibration, tmp_path, bits):
    """A gptq table keeps its codes."""
    import embedq
    ov = tmp_path / "ov"
    kw = dict(bits=bits, group_size=32, scale_dtype="float16")  # FLAGS8 / FLAGS4: what Q8_0 / Q4_0 hold
    embedq.quantize(gemma3_270m, output=ov, overlay_only=True, method="gptq", calibration=small_calibration,
                    progress=False, **kw)
    out = embedq.gguf(gemma_gguf, ov, tmp_path / "out.gguf")
    assert out.tables[0].scheme.endswith("gptq")
    assert_transcoded(gemma_gguf, tmp_path / "out.gguf", ov, EMB)
