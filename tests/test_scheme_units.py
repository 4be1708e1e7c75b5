"""The scheme units (embedq/format/scheme_units.py) and every twin held to them: the codec,
the fused RTN kernel, the C quantizer, the dispatch table's bits."""

from __future__ import annotations

import pytest
import torch

from embedq.format import codec
from embedq.format.scheme import Scheme
from embedq.format.scheme_units import UNITS, unit_for
from embedq.kernels.dispatch import ROUTES
from embedq.quant import native
from embedq.quant.rtn import quantize_rtn

UNIT_LIST = list(UNITS.values())


def _codes(unit, rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << unit.bits, (rows, cols), generator=g, dtype=torch.int32).to(torch.uint8)


@pytest.mark.parametrize("unit", UNIT_LIST, ids=repr)
def test_pack_unpack_decode_agree(unit):
    u = _codes(unit, 5, 64)
    b = unit.pack_bytes(u)
    assert b.shape == (5, unit.packed_bytes(64)) and b.dtype == torch.uint8
    assert torch.equal(unit.unpack_bytes(b, 64), u)
    signed = unit.signed_from_bytes(b)
    assert torch.equal(signed.to(torch.int16), u.to(torch.int16) - unit.offset)
    # the device-generic shift decoder reads the same bits
    words = b.reshape(-1).view(torch.int32).reshape(5, -1)
    assert words.shape[1] == unit.packed_words(64)
    assert torch.equal(codec.unpack_codes(words, unit.bits, 64).to(torch.uint8), u)
    # element i of a row sits at bits [i*bits, (i+1)*bits) of the row's bit stream
    row = int.from_bytes(bytes(b[0].tolist()), "little")
    assert [(row >> (i * unit.bits)) & unit.mask for i in range(64)] == u[0].tolist()


@pytest.mark.parametrize("unit", UNIT_LIST, ids=repr)
def test_pairs_pack_like_bytes(unit):
    u = _codes(unit, 3, 32, seed=1).to(torch.int32)
    pairs = unit.pack_pairs(u[:, 0::2], u[:, 1::2]).contiguous().view(torch.uint8).reshape(3, -1)
    assert torch.equal(pairs, unit.pack_bytes(u).to(torch.uint8))


@pytest.mark.parametrize("unit", UNIT_LIST, ids=repr)
def test_numbers_and_sizes(unit):
    assert (unit.qmin, unit.qmax) == (-(1 << (unit.bits - 1)), (1 << (unit.bits - 1)) - 1)
    assert unit_for(unit.bits) is unit and Scheme(bits=unit.bits).unit is unit
    for sym in (True, False):
        s = Scheme(bits=unit.bits, symmetric=sym, group_size=32)
        t = s.tensor_shapes((37, 128), "BF16")
        size = {"I32": 4, "I64": 8, "BF16": 2}
        total = sum(size[dt] * torch.Size(shape).numel() for dt, shape in t.values())
        assert s.overlay_bytes((37, 128), 2) == total
        assert codec.packed_zero_point_rows(37, unit.bits) == unit.zero_point_rows(37)


def test_symmetric_rules():
    x = torch.tensor([[[-3.0, 1.0, 2.0, 0.0]]])
    assert float(unit_for(8).symmetric_scale([x])) == pytest.approx(3 / 127)
    assert float(unit_for(4).symmetric_scale([x])) == pytest.approx(-3 / -8)  # signed extreme -> -8
    tie = torch.tensor([[[-2.0, 2.0, 0.0, 0.0]]])
    assert float(unit_for(4).symmetric_scale([tie])) == pytest.approx(2 / -8)  # ties keep the positive
    zero = torch.zeros(1, 1, 4)
    assert all(float(u.symmetric_scale([zero])) == 1.0 for u in UNIT_LIST)


def test_dispatch_rows_serve_every_unit():
    """Every unit's codes have a CPU kernel row and the reference row (the table's rows
    are the one place that says which layouts read which bits)."""
    for b in UNITS:
        assert any(b in r.bits and r.layout.name == "native" for r in ROUTES), b
        assert any(b in r.bits and r.layout.name == "chunked" for r in ROUTES), b


def _table(rows, cols, dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, rows).unsqueeze(1)
    x[1] = 0
    x[2, :16] = -x[2, :16].abs()
    return x.to(dtype)


SCHEMES = [(b, g, sym) for b in UNITS for g in (None, 32) for sym in (True, False)]


@pytest.mark.parametrize("bits,group,sym", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_c_quantizer_matches_the_unit(bits, group, sym, dtype, scale_dtype):
    if native.library() is None:
        pytest.skip(native.unavailable_reason())
    x = _table(24, 64, dtype)
    s = Scheme(bits=bits, symmetric=sym, group_size=group)
    q, sc, zp = quantize_rtn(x, s, scale_dtype)
    packed, sc2, zp2, _ = native.quantize_pack(x, bits, s.effective_group(64), sym, scale_dtype, False)
    assert torch.equal(packed.view(torch.int32), codec.pack_int32(q, bits))
    assert torch.equal(sc2.view(torch.uint8), sc.view(torch.uint8))
    assert (zp is None and zp2 is None) or torch.equal(zp, zp2)


@pytest.mark.parametrize("bits,group,sym", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_kernel_source_matches_the_unit(bits, group, sym, dtype):
    """The fused kernel's function (eager: what inductor compiles) against the reference."""
    from embedq.quant.fused import PAIRS_BITS, fused_rtn
    x = _table(24, 64, dtype)
    s = Scheme(bits=bits, symmetric=sym, group_size=group)
    q, sc, zp = quantize_rtn(x, s, torch.bfloat16)
    pairs = dtype == torch.bfloat16 and bits in PAIRS_BITS
    xin = x.view(torch.int32) if pairs else x
    packed, sc2, zp2, *_ = fused_rtn(xin, bits, s.effective_group(64), sym, torch.bfloat16, False, pairs)
    assert torch.equal(packed.reshape(24, -1).view(torch.int32), codec.pack_int32(q, bits))
    assert torch.equal(sc2.view(torch.uint8), sc.view(torch.uint8))
    assert (zp is None and zp2 is None) or torch.equal(zp, zp2)
