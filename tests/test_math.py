"""Quantizer and packing math against independent references and compressed-tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from embedq.format.codec import (QuantizedTable, pack_int32, pack_zero_points, unpack_int32,
                                 unpack_zero_points)
from embedq.format.scheme import Scheme
from embedq.quant.rtn import quantize_rtn
from embedq.quant.rtn import round_scale_up


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 40), words=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1))
def test_packing_is_byte_identical_to_compressed_tensors(bits, rows, words, seed):
    g = torch.Generator().manual_seed(seed)
    cols = words * 32 // bits
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (rows, cols), dtype=torch.int8, generator=g)
    ours = pack_int32(q, bits)
    assert torch.equal(ours, pack_to_int32(q, bits))
    assert torch.equal(unpack_int32(ours, bits, cols), q)
    assert torch.equal(unpack_from_int32(ours, bits, torch.Size((rows, cols))), q)
    zp = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (rows, 3), dtype=torch.int8, generator=g)
    pz = pack_zero_points(zp, bits)
    assert torch.equal(pz, pack_to_int32(zp, bits, packed_dim=0))
    assert torch.equal(unpack_zero_points(pz, bits, rows), zp)


def test_packed_bytes_are_low_nibble_first():
    q = torch.tensor([[-8, 7, 0, 1, -1, 2, 3, 4]], dtype=torch.int8)  # u = 0,15,8,9,7,10,11,12
    b = pack_int32(q, 4).view(torch.uint8).tolist()[0]
    assert b == [0xF0, 0x98, 0xA7, 0xCB]


def _reference(x: np.ndarray, bits: int, group: int, symmetric: bool):
    """Straightforward numpy reference: per-group absmax (sym) or min/max incl. 0 (asym)."""
    rows, cols = x.shape
    xg = x.reshape(rows, cols // group, group).astype(np.float64)
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if symmetric and bits == 4:  # signed-max: the signed extreme lands on -8
        lo, hi = xg.min(-1), xg.max(-1)
        scale = np.where(-lo > hi, lo, hi) / qmin
        return np.where(scale != 0, scale, 1.0)
    if symmetric:
        scale = np.abs(xg).max(-1) / qmax
    else:
        lo, hi = np.minimum(xg.min(-1), 0), np.maximum(xg.max(-1), 0)
        scale = (hi - lo) / (2**bits - 1)
    return np.where(scale > 0, scale, 1.0)


@pytest.mark.parametrize("bits,group,symmetric", [
    (8, None, True), (8, 32, True), (8, None, False), (4, 32, True), (4, 32, False), (4, 16, False),
    (8, 128, False),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rtn_error_within_half_step(bits, group, symmetric, dtype):
    torch.manual_seed(bits * 7 + (group or 0))
    x = (torch.randn(67, 256) * torch.rand(67, 1) * 3).to(dtype)
    x[3] = 0  # an all-zero row must not divide by zero
    x[5, :40] = 50.0  # an outlier group
    s = Scheme.default(bits, symmetric, group)
    q, scale, zp = quantize_rtn(x, s, dtype)
    assert q.dtype == torch.int8 and scale.dtype == dtype
    assert int(q.min()) >= s.qmin and int(q.max()) <= s.qmax
    t = QuantizedTable.from_codes(q, scale, zp, bits, s.group_size)
    xhat = t.dequantize(torch.float32)
    g = s.effective_group(256)
    step = scale.float().abs().repeat_interleave(g, dim=1)
    err = (xhat - x.float()).abs()
    half = err <= step / 2 * (1 + 1e-5) + 1e-7
    if symmetric and bits == 4:
        # signed-max: only a value of the other sign than the extreme, clipped to code 7,
        # misses by more than half a step, and by at most one
        assert bool((half | (q == s.qmax)).all())
        assert bool((err <= step * (1 + 1e-5) + 1e-7).all())
        nz = scale.float() != 1
        assert bool(((q.reshape(67, -1, g) == s.qmin).any(-1) | ~nz).all())  # the extreme is -8
    else:
        assert bool(half.all()), float((err - step / 2).max())
    # the stored scale is the reference scale, its magnitude rounded up to the storage dtype
    ref = torch.from_numpy(_reference(x.float().numpy(), bits, g, symmetric)).float()
    assert bool((torch.sign(scale.float()) == torch.sign(ref)).all())
    assert bool((scale.float().abs() >= ref.abs() * (1 - 1e-6)).all())
    rel = {torch.float32: 1e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
    assert bool((scale.float().abs() <= ref.abs() * (1 + rel) + 1e-30).all())


def test_round_scale_up_never_rounds_down():
    s = torch.rand(10000) * 10 + 1e-3
    for dt in (torch.bfloat16, torch.float16):
        r = round_scale_up(s, dt)
        assert bool((r.float() >= s).all())
        n = round_scale_up(-s, dt)  # signed-max scales: the magnitude is rounded up
        assert torch.equal(n.float(), -r.float())


def test_signed_max_4bit_matches_the_builder_mapping():
    """4-bit sym = onnxruntime's int4 RTN (MLAS ``MlasQuantizeBlockwise``): ``m`` = the
    group's element of largest magnitude (ties: the positive one), ``scale = m / -8``,
    codes ``clamp(round(x / scale), -8, 7)``; bf16 scales of a bf16 table equal the
    float32 ones (``m / -8`` is exact)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 128, generator=g) * 2).to(torch.bfloat16)
    x[0, :32] = torch.linspace(-1, 1, 32)  # a tie: +1 and -1
    x[1, :32] = 0
    xg = x.float().reshape(64, 4, 32)
    lo, hi = xg.amin(-1), xg.amax(-1)
    m = torch.where(lo.abs() > hi, lo, hi)
    sc = torch.where(m != 0, m / -8, torch.ones_like(m))
    qr = torch.round(xg / sc.unsqueeze(-1)).clamp(-8, 7).reshape(64, 128).to(torch.int8)
    for dt in (torch.float32, torch.bfloat16):
        q, s, zp = quantize_rtn(x, Scheme.default(4, True, 32), dt)
        assert zp is None and torch.equal(q, qr) and torch.equal(s.float(), sc)
    assert float(s[0, 0]) == -1 / 8 and int(q[0, 0]) == 7  # -1 / (-1/8) = 8 -> clipped to 7


@pytest.mark.parametrize("bits,group,symmetric", [(8, None, True), (4, 32, True), (4, 32, False),
                                                  (8, 64, False)])
def test_compressed_tensors_decompressor_matches(bits, group, symmetric):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    torch.manual_seed(1)
    x = torch.randn(40, 128).to(torch.bfloat16)
    s = Scheme.default(bits, symmetric, group)
    q, scale, zp = quantize_rtn(x, s, torch.bfloat16)
    t = QuantizedTable.from_codes(q, scale, zp, bits, s.group_size)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy=s.strategy, group_size=s.group_size)
    scheme = QuantizationScheme(targets=["Embedding"], weights=args)
    sd = {"weight_packed": t.packed, "weight_scale": scale, "weight_shape": torch.tensor([40, 128])}
    if zp is not None:
        sd["weight_zero_point"] = t.packed_zero_point()
    out = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
    # (q - zp) is exact and the product of a <=8-bit integer and a bf16 scale is exact
    # in float32, so both sides round once to bf16: bit-identical.
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, t.dequantize(torch.bfloat16))


def test_scheme_rejects_bad_shapes():
    from embedq.errors import SchemeError
    with pytest.raises(SchemeError, match="not divisible by group size 32"):
        Scheme.default(4).check_shape((10, 48), "t")
    with pytest.raises(SchemeError, match="not supported"):
        Scheme.default(3)
    with pytest.raises(SchemeError, match="2-D"):
        Scheme.default(8).check_shape((10,), "t")
