"""The 4-bit dword layout (``layouts.NativeQ4D``, opt-in ``EMBEDQ_SERVE_KERNEL=native_q4d``):
every row of it against the reference decoder and, bit for bit, against the pair layout's
row of the same ISA (the same integer sums and float32 operations, only the bytes grouped
otherwise), every 4-bit scheme, activation dtype and M; the gather exact; refusals said."""

from __future__ import annotations

import itertools

import pytest
import torch

from embedq.kernels import PreparedTable, dispatch, native_f32
from embedq.kernels.layouts import NativeQ4D
from tests.perf.test_cpu_variants import _table
from tests.perf.fastpathutil import _check_linear, _wabs

BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
ROWS = {r.isa: r for r in dispatch.ROUTES if r.layout is NativeQ4D}
# (group, sym, rows, cols, scale dtype): vocab never a multiple of 16, odd group counts
CASES = [(32, True, 1001, 96, BF), (32, False, 1001, 96, BF), (64, False, 777, 192, BF),
         (128, True, 531, 384, BF), (None, False, 1001, 192, BF), (32, False, 333, 96, F16),
         (64, True, 333, 192, F32), (8, False, 101, 24, BF)]
MS = (1, 2, 3, 4, 5, 8, 17, 64)


def _select(isa: str, monkeypatch) -> None:
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", ",".join(ROWS[isa].lib.needs))
    why = ROWS[isa].lib.unavailable()
    if why is not None:
        pytest.skip(why)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == F32 else torch.int16)


def test_rows_cover_the_avx2_builds():
    assert sorted(ROWS) == sorted(native_f32.Q4D_VARIANTS)
    assert all(r.bits == (4,) and r.act == "exact" for r in ROWS.values())


@pytest.mark.parametrize("isa", sorted(ROWS))
@pytest.mark.parametrize("group,sym,rows,cols,sd", CASES,
                         ids=[f"{'row' if g is None else f'g{g}'}-{'sym' if s else 'asym'}-{r}x{c}-s_{str(d)[6:]}"
                              for g, s, r, c, d in CASES])
def test_dword_rows_match_the_pair_layout_bit_for_bit(isa, group, sym, rows, cols, sd, monkeypatch):
    _select(isa, monkeypatch)
    qt = _table(4, group, sym, rows, cols, sd)
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "native")
    pair = PreparedTable.from_table(qt)
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "native_q4d")
    p = PreparedTable.from_table(qt)
    assert p.kind == "native_q4d" and pair.kind == "native", (p.describe(), pair.describe())
    wabs, gen = _wabs(qt), torch.Generator().manual_seed(cols)
    for m, dt in itertools.product(MS, (BF, F16, F32)):
        x = torch.randn(m, cols, generator=gen).to(dt)
        if m == 1:
            x[0, :3] = torch.tensor([1e-3, 37.0, -2.5e-6]).to(dt)  # several planes per group
        _check_linear(p, qt, x, wabs)
        assert p.last_kernel == ROWS[isa].kernel, (p.last_kernel, m, dt)
        ref = pair.linear(x)
        assert pair.last_kernel == f"native_{isa}", pair.last_kernel
        assert torch.equal(_bits(p.linear(x)), _bits(ref)), (m, dt)
    ids = torch.tensor([0, 1, rows - 1, 17, rows // 2])
    for dt in (BF, F16, F32):
        assert torch.equal(p.embedding(ids, dt), qt.dequantize(dt, rows=ids))


@pytest.mark.parametrize("isa", sorted(ROWS))
def test_dword_large_batch_and_float32_fallback(isa, monkeypatch):
    """M = 256 over a table past one KC chunk; an M = 1 float32 row no int16 plane holds (the
    float path, direct4 over the dwords) — both bit for bit the pair layout's."""
    _select(isa, monkeypatch)
    qt = _table(4, 64, False, 2000, 320, BF)
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "native")
    pair = PreparedTable.from_table(qt)
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "native_q4d")
    p = PreparedTable.from_table(qt)
    gen = torch.Generator().manual_seed(5)
    x256 = torch.randn(256, 320, generator=gen)
    x1 = torch.randn(1, 320, generator=gen) * (1 + 2.0 ** -20)  # > 15 significant bits
    lib = ROWS[isa].lib.get()
    assert lib.head_f32_planes(x1.data_ptr(), 320, 64, 4) == 0
    for x in (x256, x256.to(BF), x1):
        _check_linear(p, qt, x, _wabs(qt))
        assert p.last_kernel == ROWS[isa].kernel
        assert torch.equal(_bits(p.linear(x)), _bits(pair.linear(x)))


@pytest.mark.parametrize("group,sym,rows,cols,sd", CASES,
                         ids=[f"{'row' if g is None else f'g{g}'}-{'sym' if s else 'asym'}-{r}x{c}-s_{str(d)[6:]}"
                              for g, s, r, c, d in CASES])
def test_avx2vnni_dword_source_on_simde_equals_avx2(group, sym, rows, cols, sd, monkeypatch):
    """The avx2vnni dword row where no AVX-VNNI CPU is at hand (its cases above skip here): its
    source over SIMDe's vpdpwssd equals the AVX2 dword build bit for bit, every M and dtype."""
    from tests.perf.test_cpu_variants import _emulated
    lib = _emulated(avx512=False, vnni=True, q4d=True)
    _select("avx2", monkeypatch)
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "native_q4d")
    qt = _table(4, group, sym, rows, cols, sd)
    p = PreparedTable.from_table(qt)
    assert p.kind == "native_q4d", p.describe()
    L, sp, gen = p.layout, p.layout.spec, torch.Generator().manual_seed(cols)
    for m, dt in itertools.product((*MS, 256), (BF, F16, F32)):
        x = torch.randn(m, cols, generator=gen).to(dt)
        if m == 1:
            x[0, :3] = torch.tensor([1e-3, 37.0, -2.5e-6]).to(dt)  # several planes per group
        args = (L.w, L.s, L.z, sp.bits, sp.rows, sp.cols, sp.group, x)
        want = native_f32.head(ROWS["avx2"].lib, *args)
        assert torch.equal(_bits(native_f32.head(lib, *args)), _bits(want)), (m, dt)


def test_dword_layout_is_opt_in_and_says_why_it_refuses(monkeypatch):
    if ROWS["avx2"].lib.unavailable():
        pytest.skip(ROWS["avx2"].lib.unavailable())
    monkeypatch.delenv("EMBEDQ_SERVE_KERNEL", raising=False)
    assert PreparedTable.from_table(_table(4, 32, True, 101, 96, BF)).kind != "native_q4d"
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "native_q4d")
    assert PreparedTable.from_table(_table(8, 32, True, 101, 96, BF)).kind == "chunked"  # no 8-bit row
    monkeypatch.setenv("EMBEDQ_ACTIVATIONS", "int8")
    p = PreparedTable.from_table(_table(4, 32, True, 101, 96, BF))
    assert p.kind == "chunked" and "EMBEDQ_ACTIVATIONS=int8" in p.describe(), p.describe()
