"""The Triton kernels (embedq.kernels.triton_head) against the reference decoder (codec).

Runs on CUDA when there is a GPU, else in Triton's interpreter (``TRITON_INTERPRET=1``,
set here before the first kernel is built) on CPU tensors; the interpreter cannot do
bf16, so bf16 is covered on GPUs only. Without Triton (the main venv) the kernel tests
skip with that reason; run them in the vLLM venv, which ships Triton:
``scripts/test_vllm.sh`` does (``~/.cache/embedq/vllm-venv/bin/python -m pytest tests/gpu``).
The dispatch tests (mocked device checks) need no Triton.

Logits bound (see tests/perf/fastpathutil.py for the derivation): the kernel's dot sees
the exact integers ``q - zp``, accumulates in float32 and applies the float32 scale, so
its error is one output rounding plus float32 accumulation; the reference (float64 here)
has none. Per element ``|y - ref| <= (2u + K*2^-24) * A``, ``A = |x| @ |W|^T``.
"""

from __future__ import annotations

import dataclasses

import importlib.util
import os
import warnings

import pytest
import torch

from embedq.format.codec import QuantizedTable
from embedq.kernels import dispatch
from embedq.kernels import PreparedTable, prepared, triton_head

HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if HAS_TRITON and not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated
DEV = "cuda" if GPU else "cpu"
# scripts/test_vllm.sh runs this file in the vLLM venv with EMBEDQ_REQUIRE_TRITON=1: there a
# missing Triton fails the kernel tests instead of skipping them
needs_triton = pytest.mark.skipif(not HAS_TRITON and os.environ.get("EMBEDQ_REQUIRE_TRITON") != "1",
                                  reason="Triton is not installed in this environment (run in the "
                                  "vLLM venv, which ships it: scripts/test_vllm.sh)")

F16, F32, BF = torch.float16, torch.float32, torch.bfloat16
DTYPES = (F32, F16, BF) if GPU else (F32, F16)
U = {BF: 2.0 ** -8, F16: 2.0 ** -11, F32: 2.0 ** -24}

# (bits, group_size, symmetric): int8 per row and groups, 4-bit groups 32-128, sym + asym
SCHEMES = [(8, None, True), (8, None, False), (8, 32, False), (8, 64, True), (8, 64, False),
           (4, None, False), (4, 32, True), (4, 32, False), (4, 64, False), (4, 128, True),
           (4, 128, False)]
V = 1000  # not a multiple of any BN (64, 128)


def _cols(g: int | None) -> int:
    # per row: 200 is not a multiple of BK (64, 128); groups: 3 (odd) groups
    return 200 if g is None else 3 * g


def _sid(s):
    b, g, sym = s
    return f"int{b}-{'row' if g is None else f'g{g}'}-{'sym' if sym else 'asym'}"


def _table(bits, g, sym, rows=V, scale_dtype=F16, seed=0) -> QuantizedTable:
    cols = _cols(g)
    gen = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (rows, cols), generator=gen, dtype=torch.int8)
    q[0] = lo  # the extreme codes, exercised in every word position
    q[1] = hi - 1
    G = 1 if g is None else cols // g
    s = (torch.rand(rows, G, generator=gen) * 0.02 + 1e-3).to(scale_dtype)
    zp = None if sym else torch.randint(lo, hi, (rows, G), generator=gen, dtype=torch.int8)
    if zp is not None:
        zp[2] = lo  # |q - zp| up to 2^bits - 1
    return QuantizedTable.from_codes(q, s, zp, bits, g)


def _on(qt: QuantizedTable):
    zp = None if qt.zero_point is None else qt.zero_point.to(DEV)
    return qt.packed.to(DEV), qt.scale.to(DEV), zp


def _assert_logits(y, x, W):
    """y [M, V] against x @ W^T in float64, within the bound of the module doc."""
    assert y.dtype == x.dtype and y.shape == (x.shape[0], W.shape[0])
    xd, Wd = x.double().cpu(), W.double()
    ref = xd @ Wd.t()
    A = xd.abs() @ Wd.abs().t()
    tol = (2 * U[x.dtype] + W.shape[1] * 2.0 ** -24) * A + 1e-30
    err = (y.double().cpu() - ref).abs()
    assert (err <= tol).all(), f"max err/bound {(err / tol).max():.3g}"


@needs_triton
@pytest.mark.parametrize("scheme", SCHEMES, ids=_sid)
@pytest.mark.parametrize("M", [1, 5, 64])
def test_logits_match_reference(scheme, M):
    bits, g, sym = scheme
    qt = _table(bits, g, sym)
    W = qt.dequantize(F32)
    packed, scale, zp = _on(qt)
    gen = torch.Generator().manual_seed(M)
    for dt in DTYPES:
        x = torch.randn(M, qt.cols, generator=gen).to(dt).to(DEV)
        y = triton_head.logits(x, packed, scale, zp, bits=bits, group_size=g, cols=qt.cols)
        _assert_logits(y, x, W)


@needs_triton
@pytest.mark.parametrize("M", [16, 17, 65, 130])
def test_logits_every_launch_config(M):
    """Each row of CONFIGS, and M not a multiple of its BM (int8 g64 asym, 4-bit g32)."""
    for bits, g, sym in [(8, 64, False), (4, 32, True)]:
        qt = _table(bits, g, sym, rows=300)
        packed, scale, zp = _on(qt)
        x = torch.randn(M, qt.cols, generator=torch.Generator().manual_seed(M)).to(F16).to(DEV)
        y = triton_head.logits(x, packed, scale, zp, bits=bits, group_size=g, cols=qt.cols)
        _assert_logits(y, x, qt.dequantize(F32))


@needs_triton
@pytest.mark.parametrize("scheme", SCHEMES, ids=_sid)
def test_gather_bit_exact(scheme):
    bits, g, sym = scheme
    qt = _table(bits, g, sym, scale_dtype=BF)  # bf16 scales: upcast under the interpreter
    packed, scale, zp = _on(qt)
    ids = torch.tensor([[0, 1, 2, V - 1], [17, 17, 999, 500]])
    for dt in (F32, F16, BF):
        rows = triton_head.gather(ids.to(DEV), packed, scale, zp, bits=bits, group_size=g,
                                  cols=qt.cols, dtype=dt)
        ref = qt.dequantize(dt, rows=ids.reshape(-1)).view(2, 4, qt.cols)
        assert rows.dtype == dt and torch.equal(rows.cpu(), ref), dt


@needs_triton
def test_bf16_scales_and_empty_batches():
    qt = _table(4, 32, False, rows=130, scale_dtype=BF)
    packed, scale, zp = _on(qt)
    x = torch.randn(3, qt.cols).to(F16).to(DEV)
    _assert_logits(triton_head.logits(x, packed, scale, zp, bits=4, group_size=32, cols=qt.cols),
                   x, qt.dequantize(F32))
    assert triton_head.logits(x[:0], packed, scale, zp, bits=4, group_size=32,
                              cols=qt.cols).shape == (0, 130)
    e = triton_head.gather(torch.zeros(0, 5, dtype=torch.long).to(DEV), packed, scale, zp,
                           bits=4, group_size=32, cols=qt.cols, dtype=F16)
    assert e.shape == (0, 5, qt.cols)


def test_unsupported_shapes_named():
    assert triton_head.unsupported(8, 24, 96) is not None  # groups not a multiple of 16
    assert triton_head.unsupported(4, None, 100) is not None  # 400 bits: not whole words
    assert triton_head.unsupported(4, 32, 96) is None
    with pytest.raises(ValueError, match="multiples of 16"):
        qt = _table(8, 64, True, rows=8)
        triton_head.logits(torch.zeros(1, qt.cols), qt.packed, qt.scale, None, bits=8,
                           group_size=8, cols=qt.cols)


# -- dispatch: PreparedTable picks the Triton kernels ------------------------------------------

def _prepared_on_cuda(monkeypatch, qt, why):
    """A PreparedTable built on CPU, then re-dispatched as if its device were CUDA with the
    Triton check answering ``why`` (mocked: no GPU needed)."""
    monkeypatch.delenv("EMBEDQ_SERVE_KERNEL", raising=False)
    seen = []
    monkeypatch.setattr(triton_head, "available",
                        lambda d: seen.append(torch.device(d).type) or why)
    t = PreparedTable.from_table(qt, device="cpu", dtype=BF)
    assert t.kind != "triton" and seen == []  # CPU, not forced: the CPU kernels, no check
    spec = dataclasses.replace(t.spec, device=torch.device("cuda"))
    layout, refused = dispatch.choose_layout(spec)
    return spec, layout.name, refused, seen


@pytest.mark.parametrize("scheme", [(8, None, True), (8, 64, False), (4, 32, False)], ids=_sid)
def test_dispatch_picks_triton_for_cuda(monkeypatch, scheme):
    t, layout, refused, seen = _prepared_on_cuda(monkeypatch, _table(*scheme, rows=64), None)
    assert layout == "triton" and refused == [] and seen == ["cuda"]


def test_dispatch_without_triton_warns_and_falls_back(monkeypatch):
    # the dispatch names why (PreparedTable.from_packed warns once with these reasons)
    t, layout, refused, _ = _prepared_on_cuda(monkeypatch, _table(4, 32, True, rows=64),
                                              "Triton is not installed")
    assert layout == "chunked" and refused == ["triton: Triton is not installed"]
    # an unsupported shape is named too
    t, layout, refused, _ = _prepared_on_cuda(monkeypatch, _table(8, 64, True, rows=64), None)
    layout, refused = dispatch.choose_layout(dataclasses.replace(t, group_size=8))
    assert layout.name != "triton" and "multiples of 16" in refused[0]


@needs_triton
@pytest.mark.skipif(GPU, reason="the CPU override is for the interpreter")
@pytest.mark.parametrize("scheme", [(8, None, False), (8, 64, True), (4, 32, False)], ids=_sid)
def test_forced_on_cpu_serves_both_paths_from_one_table(monkeypatch, scheme):
    """EMBEDQ_SERVE_KERNEL=triton: CPU tensors go through the kernels (interpreter), the
    stored tensors are kept as they are (one table), and both paths match the reference."""
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "triton")
    calls = []
    for name in ("logits", "gather"):
        real = getattr(triton_head, name)
        monkeypatch.setattr(triton_head, name,
                            lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    qt = _table(*scheme, rows=300)
    t = PreparedTable.from_table(qt, device="cpu", dtype=F16)
    stored = qt.packed.numel() * 4 + qt.scale.numel() * 2 + (
        0 if qt.zero_point is None else qt.zero_point.numel())  # int8 zero points, unpacked
    assert t.kind == "triton" and t.nbytes == stored
    x = torch.randn(2, 3, qt.cols).to(F16)
    y = t.linear(x)
    _assert_logits(y.reshape(6, -1), x.reshape(6, -1), qt.dequantize(F32))
    ids = torch.tensor([[5, 299], [0, 7]])
    assert torch.equal(t.embedding(ids, F16), qt.dequantize(F16, rows=ids.reshape(-1)).view(2, 2, -1))
    assert torch.equal(t.dequantize_rows(ids.reshape(-1), F32), qt.dequantize(F32, rows=ids.reshape(-1)))
    assert calls == ["logits", "gather"]


def test_forced_without_interpreter_is_refused_with_reason(monkeypatch):
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    why = triton_head.available("cpu")
    assert why is not None and ("TRITON_INTERPRET=1" in why or "not installed" in why)
