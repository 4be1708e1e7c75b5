"""``--method gptq``: head-aware, calibrated; never worse than RTN on its own objective."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedq.errors import SchemeError
from embedq.format.codec import QuantizedTable
from embedq.format.scheme import Scheme
from embedq.quant.rtn import quantize_rtn
from embedq.quant.gptq import Calibration, quantize_gptq
from embedq.quant.mse import quantize_mse
from embedq.format.codec import dequantize_codes

from tests.methods.test_mse import _ct_decompress, _data, _ort_gather


def _spd(cols: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    """A second-moment matrix like a head's: a few directions dominate."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4 * cols, cols, generator=g) * torch.logspace(0, spread, cols)[torch.randperm(cols, generator=g)]
    return (a.T @ a / a.shape[0]).double()


def _objective(x, q, s, zp, group, hd) -> np.ndarray:
    e = (dequantize_codes(q, s, zp, group).double() - x.double())
    return ((e @ hd) * e).sum(-1).numpy()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bits=st.sampled_from([4, 8]), group=st.sampled_from([None, 16, 32]),
       symmetric=st.booleans(), kind=st.sampled_from(["normal", "student_t", "outliers", "skewed"]),
       rows=st.integers(1, 24), seed=st.integers(0, 2**31 - 1),
       damp=st.sampled_from([0.01, 1.0, 10.0]))
def test_gptq_never_worse_than_rtn_on_head_objective(bits, group, symmetric, kind, rows, seed, damp):
    cols = 64
    x = _data(kind, rows, cols, seed, torch.bfloat16)
    cal = Calibration(_spd(cols, seed), damp=damp)
    scheme = Scheme(bits=bits, symmetric=symmetric, group_size=group, method="gptq")
    q, s, zp = quantize_gptq(x, scheme, torch.bfloat16, cal)
    assert q.dtype == torch.int8 and int(q.min()) >= scheme.qmin and int(q.max()) <= scheme.qmax
    # (4-bit sym: RTN's signed-max scales may be negative)
    assert s.dtype == torch.bfloat16 and bool(((s.float() > 0) | (symmetric and bits == 4)).all())
    assert (zp is None) == symmetric
    qr, sr, zr = quantize_rtn(x, scheme, torch.bfloat16)
    hd = cal.damped()
    assert (_objective(x, q, s, zp, group, hd) <= _objective(x, qr, sr, zr, group, hd) * (1 + 1e-9)).all()


def test_gptq_lowers_head_objective_a_lot():
    torch.manual_seed(0)
    x = (torch.randn(512, 128) * 0.05).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2048, 8, generator=g) @ torch.randn(8, 128, generator=g) + 0.1 * torch.randn(2048, 128, generator=g)
    cal = Calibration((a.T @ a / 2048).double(), damp=0.01)  # correlated inputs, like a head's
    scheme = Scheme(bits=4, symmetric=False, group_size=32, method="gptq")
    hd = cal.damped()
    og = _objective(x, *quantize_gptq(x, scheme, torch.bfloat16, cal), 32, hd).sum()
    orr = _objective(x, *quantize_rtn(x, scheme, torch.bfloat16), 32, hd).sum()
    om = _objective(x, *quantize_mse(x, scheme, torch.bfloat16), 32, hd).sum()
    assert og < 0.5 * orr and og < 0.5 * om


def test_protected_rows_get_plain_mse():
    torch.manual_seed(0)
    x = (torch.randn(64, 64) * 0.05).to(torch.bfloat16)
    x[5, 3] = 1.0  # an attention-sink-like row
    cal = Calibration(_spd(64, 2), protected=x[5:6].float(), damp=1.0)
    scheme = Scheme(bits=8, symmetric=False, group_size=None, method="gptq")
    q, s, zp = quantize_gptq(x, scheme, torch.bfloat16, cal)
    qm, sm, zm = quantize_mse(x[5:6], scheme, torch.bfloat16)
    assert torch.equal(q[5:6], qm) and torch.equal(s[5:6], sm) and torch.equal(zp[5:6], zm)


def test_gptq_without_calibration_is_a_clear_error():
    with pytest.raises(SchemeError, match="calibration"):
        quantize_gptq(torch.randn(4, 32), Scheme(bits=4, group_size=32, method="gptq"), torch.float32)
    with pytest.raises(SchemeError, match="columns"):
        quantize_gptq(torch.randn(4, 32), Scheme(bits=4, group_size=32, method="gptq"), torch.float32,
                      Calibration(_spd(64, 0)))


@pytest.mark.parametrize("bits,group,symmetric", [(8, None, True), (8, None, False), (4, 32, True),
                                                  (4, 32, False)])
def test_gptq_output_reads_back_like_rtn(bits, group, symmetric):
    torch.manual_seed(bits)
    x = (torch.randn(96, 256) * torch.rand(96, 1)).to(torch.bfloat16)
    scheme = Scheme(bits=bits, symmetric=symmetric, group_size=group, method="gptq")
    q, s, zp = quantize_gptq(x, scheme, torch.bfloat16, Calibration(_spd(256, 3), damp=0.1))
    t = QuantizedTable.from_codes(q, s, zp, bits, group)
    assert torch.equal(_ct_decompress(t, scheme), t.dequantize(torch.bfloat16))
    idx = np.array([0, 7, 95, 7], dtype=np.int64)
    np.testing.assert_array_equal(_ort_gather(t, idx),
                                  t.dequantize(torch.float32, rows=torch.from_numpy(idx)).numpy())


def _tokenizer(folder, vocab_size):
    import transformers as tf
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0, "<s>": 1}
    vocab.update({chr(c): c - 30 for c in range(32, 127)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="[UNK]").save_pretrained(folder)


@pytest.mark.parametrize("kind", ["qwen2_tied", "llama_untied_fp32"])
def test_quantize_checkpoint_with_gptq(model_factory, kind):
    import embedq
    path = model_factory(kind)
    _tokenizer(path, 512)
    untied = "untied" in kind
    report = embedq.quantize(path, bits=4, method="gptq", lm_head=untied, progress=False)
    cfg = json.loads((path / "quantization_config.json").read_text())
    methods = {m: e["method"] for m, e in cfg["modules"].items()}
    if untied:  # the gather-only embedding gets mse; the head gptq
        assert methods == {"model.embed_tokens": "mse", "lm_head": "gptq"}
    else:
        assert methods == {"model.embed_tokens": "gptq"}
    assert report.modules
    embedq.verify(path)
    ov = embedq.load_overlay(path)
    assert all(t.bits == 4 for t in ov.tables.values())


def _no_calibration_run(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("collect_calibration ran")
    monkeypatch.setattr("embedq.jobs.calibration.collect_calibration", refuse)


def _methods(path) -> dict[str, str]:
    cfg = json.loads((path / "quantization_config.json").read_text())
    return {m: e["method"] for m, e in cfg["modules"].items()}


def test_gptq_on_a_gather_only_table_runs_no_calibration(model_factory, monkeypatch):
    """Untied, no --lm-head: no head reads the table, so it gets mse without the calibration
    run (which would fail here: the checkpoint has no tokenizer)."""
    from tests.ckptutil import run_cli
    path = model_factory("llama_untied_sharded")
    _no_calibration_run(monkeypatch)
    code, out = run_cli("quantize", path, "--bits", "4", "--method", "gptq", "--quiet")
    assert code == 0, out
    assert _methods(path) == {"model.embed_tokens": "mse"}
    out_dir = path.parent / "derived"
    code, out = run_cli("quantize", path, "--bits", "4", "--method", "gptq", "--quiet",
                        "--output", out_dir)
    assert code == 0, out
    assert _methods(out_dir) == {"model.embed_tokens": "mse"}


def test_gptq_with_lm_head_still_calibrates(model_factory):
    """--lm-head: the head reads its table, so calibration runs (no tokenizer: refused as before)."""
    from tests.ckptutil import assert_one_line_error, run_cli, snapshot
    path = model_factory("llama_untied_sharded")
    before = snapshot(path)
    code, out = run_cli("quantize", path, "--bits", "4", "--method", "gptq", "--lm-head", "--quiet")
    assert_one_line_error(code, out, "no usable tokenizer")
    assert snapshot(path) == before


def test_gptq_uses_a_given_calibration(model_factory, monkeypatch):
    """``embedq.quantize(..., calibration=cal)``: used for the head, never collected again."""
    import embedq
    path = model_factory("llama_untied_sharded")
    _no_calibration_run(monkeypatch)
    cal = Calibration(_spd(64, 1), damp=1.0)
    embedq.quantize(path, bits=4, method="gptq", lm_head=True, calibration=cal, progress=False)
    assert _methods(path) == {"model.embed_tokens": "mse", "lm_head": "gptq"}
    embedq.verify(path)
    path = model_factory("llama_untied_sharded")  # no head reads it: the calibration goes unused
    embedq.quantize(path, bits=4, method="gptq", calibration=cal, progress=False)
    assert _methods(path) == {"model.embed_tokens": "mse"}


@pytest.mark.parametrize("method", ["mse", "gptq"])
@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, False), (8, None, True)])
def test_streaming_chunks_do_not_change_the_output(method, bits, group, symmetric):
    """Rows are independent: the writer's chunking gives the same bytes as one chunk."""
    torch.manual_seed(0)
    x = (torch.randn(640, 256) * torch.rand(640, 1)).to(torch.bfloat16)
    cal = Calibration(_spd(256, 4), x[5:6].float(), 1.0)
    scheme = Scheme(bits=bits, symmetric=symmetric, group_size=group, method=method)
    fn = (lambda t: quantize_gptq(t, scheme, torch.bfloat16, cal)) if method == "gptq" else \
        (lambda t: quantize_mse(t, scheme, torch.bfloat16))
    whole = fn(x)
    parts = [fn(x[i:i + 64]) for i in range(0, 640, 64)]
    for k in range(3):
        if whole[k] is None:
            assert all(p[k] is None for p in parts)
        else:
            assert torch.equal(whole[k], torch.cat([p[k] for p in parts]))
