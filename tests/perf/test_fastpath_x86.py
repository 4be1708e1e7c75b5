"""The x86 native kernels' own paths against the reference (bound in ``fastpathutil.py``):
the AMX row (M = 256, streaming stores past 8 MiB, the int8 scaled decode, column counts
not a whole tile, taken away by EMBEDQ_CPU_FEATURES), the vdpbf16ps kernel (staged block
pairs at every thread count, its prefetch and 4-bit decode forms bit for bit), and the row
order CPU flags and vendor choose (decided on the flags alone, so those run on every CPU).
Every scheme and layout's general cases are in ``test_fastpath.py``.
"""

from __future__ import annotations

import pytest
import torch

from embedq.kernels import layouts
from embedq.kernels import PreparedTable, dispatch, native_head
from tests.perf.fastpathutil import (BF, F16, F32, NATIVE_LAYOUT, _bound, _check_linear, _native_kernel,
                                     _reference, _table, _wabs, _xs)


@pytest.mark.parametrize("bits,group", [(4, 64), (8, None)])
def test_amx_large_batch_and_taken_away(bits, group, monkeypatch):
    """The AMX row at M = 256 (8 pairs of activation tiles, an odd block count per thread),
    asymmetric; ``EMBEDQ_CPU_FEATURES=-amx_bf16`` takes it away (the next row serves)."""
    why = native_head.AMX_LIB.unavailable()
    if why is not None:
        pytest.skip(why)
    qt = _table(bits, group, False, 2000, 320)
    x = torch.randn(256, 320, generator=torch.Generator().manual_seed(5)).to(BF)
    p = PreparedTable.from_table(qt)
    _check_linear(p, qt, x, _wabs(qt))
    assert p.last_kernel == "native_amx"
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", "-amx_bf16,-amx_tile")
    p = PreparedTable.from_table(qt)
    _check_linear(p, qt, x[:8], _wabs(qt))
    assert p.last_kernel == "native_bf16"
    _check_linear(p, qt, x, _wabs(qt))  # M = 256 without AMX: the AVX-512F row's 6 x 64 tiles
    assert p.last_kernel == _native_kernel(BF, p.spec, 256) == "native_avx512f"


@pytest.mark.parametrize("bits,group,sym,dt,m", [(4, 32, True, BF, 33), (8, 64, False, F32, 17)])
def test_amx_streaming_stores_past_8_mib(bits, group, sym, dt, m):
    """Outputs from 8 MiB leave the AMX kernel by streaming stores, a whole 64-byte line where
    it is aligned and masked stores elsewhere: an odd row count (each output row starts at
    another offset in its line, the last block half empty) at both output widths."""
    why = native_head.AMX_LIB.unavailable()
    if why is not None:
        pytest.skip(why)
    qt = _table(bits, group, sym, 131_111, 64, seed=3)
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(7)).to(dt)
    assert m * qt.rows * x.element_size() >= 8 << 20  # native_amx.c: nt
    p = PreparedTable.from_table(qt)
    _check_linear(p, qt, x, _wabs(qt))
    assert p.last_kernel == "native_amx"


@pytest.mark.parametrize("group,sym,dt", [(64, True, BF), (None, False, F32), (32, False, F16)])
def test_amx_int8_scaled_decode_is_bit_identical(group, sym, dt):
    """int8 tables on AMX decode codes to q * 2^-112 against activations times 2^56 when every
    activation part lies in [2^-63, 2^63], else exactly (native_amx.c): one row out of that
    range switches the whole call to the exact decode, and the other rows' logits are the
    same bits either way (and within the reference's bound)."""
    why = native_head.AMX_LIB.unavailable()
    if why is not None:
        pytest.skip(why)
    qt = _table(8, group, sym, 1000, 128, seed=11)
    x = torch.randn(17, 128, generator=torch.Generator().manual_seed(3)).to(dt)
    p = PreparedTable.from_table(qt)
    got = p.linear(x)
    assert p.last_kernel == "native_amx"
    _check_linear(p, qt, x, _wabs(qt))
    for odd in (1e-30, 1e30) if dt != F16 else ():  # below 2^-63 / above 2^63 (float16 never is)
        extra = torch.zeros(1, 128, dtype=dt)
        extra[0, 5] = odd
        both = p.linear(torch.cat([x, extra]))
        assert p.last_kernel == "native_amx"
        assert torch.equal(both[:17], got)


@pytest.mark.parametrize("bits,sym", [(8, True), (4, False)])
def test_columns_not_a_whole_amx_tile(bits, sym, monkeypatch):
    """80 columns (no whole number of 32-column AMX tiles): the next row serves, exactly."""
    if not NATIVE_LAYOUT:
        pytest.skip(f"no native variant here: {dispatch.layout_unavailable('native')}")
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "native")
    qt = _table(bits, None, sym, 1000, 80)
    p = PreparedTable.from_table(qt)
    assert "native_amx" not in {r.kernel for r in p.routes}
    for x in _xs(qt.cols):
        _check_linear(p, qt, x, _wabs(qt))
        assert p.last_kernel == _native_kernel(x.dtype, p.spec, x.reshape(-1, qt.cols).shape[0])


def _rows_on(hw: set[str], monkeypatch, act: str | None = None):
    """``pick(m)``: the Native row a CPU with exactly the flags ``hw`` serves bf16 activations
    of a 4-bit g32 table with at M = m (rows of ``act`` only, or every kind); no build runs."""
    from embedq.kernels import build
    monkeypatch.setattr(build, "_hardware_flags", lambda: frozenset(hw))
    monkeypatch.delenv("EMBEDQ_CPU_FEATURES", raising=False)
    spec = layouts.Spec(rows=64, cols=64, bits=4, group_size=32, symmetric=True, scale_dtype=BF, dtype=BF,
                        device=torch.device("cpu"))
    rows = [r for r in dispatch.ROUTES if r.layout is layouts.Native and dispatch._fits(r, spec)
            and (not r.cpu or r.cpu in build.cpu_flags()) and (r.lib is None or not r.lib._refused())
            and (act is None or r.act == act)]
    return lambda m: next(r for r in rows if BF in r.acts and (r.m_max is None or m <= r.m_max) and m >= r.m_min)


_AVX512_BF16 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}


@pytest.mark.parametrize("vendor,want", [("vendor_intel", "native_avx512f"), ("vendor_amd", "native_bf16"), (None, "native_bf16")])
def test_vendor_row_orders_bf16_kernels(vendor, want, monkeypatch):
    """The CPU vendor is a property rows can need (build.VENDOR_FLAGS): without AMX, bf16
    activations at M >= 16 take the AVX-512F kernel on Intel (vdpbf16ps four FMAs' time
    there) and vdpbf16ps elsewhere (Zen 4: one FMA's time); EMBEDQ_CPU_FEATURES removes the
    vendor like any feature. Decided on the flags alone: runs on every CPU."""
    row = _rows_on(_AVX512_BF16 | ({vendor} if vendor else set()), monkeypatch, act="exact")

    def pick(m):
        return row(m).kernel
    assert pick(16) == want and pick(256) == want
    assert pick(8) == "native_bf16" and pick(1) == "native_avx512f"
    if vendor:
        monkeypatch.setenv("EMBEDQ_CPU_FEATURES", f"-{vendor}")
        assert dispatch._unavailable(next(r for r in dispatch.ROUTES if r.cpu)) is not None


@pytest.mark.parametrize("bits,group,sym", [(4, 32, False), (8, None, True), (8, 32, False)])
def test_bf16_kernel_staged_block_pairs(bits, group, sym):
    """native_bf16 past one tile (M = 33, 64) stages block pairs and streams whole lines:
    every thread count (a range starting on an odd block, ending on an even one) and a
    partial last block inside a pair (1010 rows: 64 blocks, the last holding 2 rows)."""
    why = native_head.unavailable()
    if why is not None:
        pytest.skip(why)
    qt = _table(bits, group, sym, 1010, 96)
    p = PreparedTable.from_table(qt)
    gen = torch.Generator().manual_seed(7)
    n0 = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for m in (33, 64):
                x = torch.randn(m, 96, generator=gen).to(BF)
                got = layouts.Native.head_bf16(p.layout, x)
                err = (got.float() - _reference(qt, x).float()).abs()
                assert (err <= _bound(qt, x, x.float().abs() @ _wabs(qt).t())).all(), (n, m)
    finally:
        torch.set_num_threads(n0)


@pytest.mark.parametrize("vendor", ["vendor_amd", "vendor_intel"])
def test_int8_activations_serve_every_m_without_amx(vendor, monkeypatch):
    """Under EMBEDQ_ACTIVATIONS=int8, an AVX512-BF16 CPU without AMX (AMD or Intel) serves
    4-bit group tables with int8 activations at every M: the AVX512-VNNI body with its 16-row
    pass is faster than vdpbf16ps there (Zen 4: 0.76-0.82 of it from M = 16). Flags only."""
    pick = _rows_on(_AVX512_BF16 | {"avx512_vnni", vendor}, monkeypatch)
    assert {pick(m).kernel for m in (1, 2, 8, 16, 17, 64, 256)} == {"native_avx512vnni_a8"}
    assert pick(16).act == "int8"


@pytest.mark.parametrize("vendor", ["vendor_amd", "vendor_intel"])
def test_bf16_kernel_prefetch_form_by_vendor(vendor, monkeypatch):
    """The vdpbf16ps kernel's source asks for the L2 prefetch form on AMD only (flags only)."""
    monkeypatch.setattr(native_head, "cpu_flags", lambda: frozenset({vendor}))
    assert native_head._source() == native_head.source_for(vendor == "vendor_amd")
    assert native_head.source_for(True) != native_head.source_for(False)


def test_bf16_kernel_prefetch_forms_agree(monkeypatch):
    """Both prefetch forms of the vdpbf16ps kernel (built side by side on this CPU) give the
    same logits bit for bit, every scheme, M in one tile and past it."""
    from embedq.kernels import build
    why = native_head.unavailable()
    if why is not None:
        pytest.skip(why)
    libs = [build.LazyLibrary(f"head_pf{int(l2)}", lambda l2=l2: native_head.source_for(l2), native_head.FLAGS,
                              needs=native_head.NEEDS, setup=native_head._setup, openmp=True)
            for l2 in (False, True)]
    for bits, group in ((4, 32), (8, 64), (8, None)):
        qt = _table(bits, group, True, 1010, 128)
        p = PreparedTable.from_table(qt)
        for m in (2, 3, 17, 40):
            x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).to(BF)
            outs = []
            for lib in libs:
                with monkeypatch.context() as mp:
                    mp.setattr(native_head, "LIB", lib)
                    outs.append(layouts.Native.head_bf16(p.layout, x))
            assert torch.equal(*outs), (bits, group, m)


def test_bf16_kernel_dec4_forms_agree(monkeypatch):
    """The 4-bit decode's VBMI form (vpermb + vpsrlvw + vpermw over a repeated table) and the
    form CPUs without AVX512-VBMI build (Cooper Lake) give the same logits bit for bit."""
    from embedq.kernels import build
    why = native_head.unavailable()
    if why is not None:
        pytest.skip(why)
    if "avx512vbmi" not in build.cpu_flags():
        pytest.skip("CPU lacks avx512vbmi: the default build is the other form")
    plain = build.LazyLibrary("head_novbmi", native_head._source, [*native_head.FLAGS, "-DEQ_NO_VBMI_DEC4"],
                              needs=native_head.NEEDS, setup=native_head._setup, openmp=True)
    for sym in (True, False):
        qt = _table(4, 32, sym, 1010, 96)
        p = PreparedTable.from_table(qt)
        for m in (1, 3, 16, 64):
            x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(BF)
            vbmi = layouts.Native.head_bf16(p.layout, x)
            with monkeypatch.context() as mp:
                mp.setattr(native_head, "LIB", plain)
                other = layouts.Native.head_bf16(p.layout, x)
            assert torch.equal(vbmi, other), (sym, m)
