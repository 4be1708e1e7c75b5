"""The opt-in int8-activation rows (``EMBEDQ_ACTIVATIONS=int8``) of every CPU variant here.

Reference: ``F.linear`` of the activations as :mod:`embedq.kernels.actquant` rounds them
(``q * d``, float64) with the reference decoder's weights. The kernel's integer dot per
block of 32 columns is exact; the error is then float32 rounding of the per-block ``d``
product, of the group's sum, of the zero-point term and of the scale (each one 2^-24
relative rounding of a partial sum bounded by A = |q d| @ ((|q| + |z|) |s|)^T, fewer than
K of them) plus the output dtype's rounding: ``(2u + K 2^-24) A`` and, in the subnormal
range of the output dtype, half its spacing.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from embedq.kernels import PreparedTable, actquant, dispatch, native_f32
from embedq.kernels.layouts import Native
from tests.perf.test_cpu_variants import SELECT, _table
from tests.perf.fastpathutil import U, _check_linear, _wabs

BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
A8 = {r.isa: r for r in dispatch.ROUTES if r.layout is Native and r.act == "int8"}
# the exact variants' feature sets, and those of the builds that serve only these rows
SELECT = {**SELECT, **{isa: ",".join(lib.needs) for isa, lib in native_f32.A8_VARIANTS.items()}}
# (group, sym, rows, cols): vocab never a multiple of 16, odd group counts
SCHEMES = [(32, True, 1001, 96), (32, False, 777, 160), (64, True, 531, 192), (64, False, 531, 192),
           (128, True, 300, 384), (128, False, 300, 384)]
MS = (1, 2, 3, 8, 17, 64)


def _select(isa: str, monkeypatch) -> None:
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", SELECT[isa])
    monkeypatch.setenv("EMBEDQ_ACTIVATIONS", "int8")
    why = dispatch.isa_unavailable(isa)
    if why is not None:
        pytest.skip(why)


def _check(p: PreparedTable, qt, x: torch.Tensor, kernel: str) -> None:
    got = p.linear(x)
    assert p.last_kernel == kernel, (p.last_kernel, tuple(x.shape), x.dtype)
    q, d = actquant.quantize(x)
    xq = actquant.dequantize(q, d).double()
    ref = xq @ qt.dequantize(F32).double().t()
    a = xq.abs() @ _wabs(qt).double().t()
    tiny = {F16: 2.0 ** -25, BF: 2.0 ** -134, F32: 2.0 ** -150}[x.dtype]  # half the subnormal spacing
    bound = (2 * U[x.dtype] + qt.cols * 2.0 ** -24) * a + tiny
    worst = ((got.double() - ref).abs() / bound).max().item()
    assert worst <= 1, f"{p.describe()} {x.dtype} {tuple(x.shape)}: error {worst:.2f}x the bound"


@pytest.mark.parametrize("isa", sorted(A8))
@pytest.mark.parametrize("group,sym,rows,cols", SCHEMES)
def test_int8_activations_match_reference(isa, group, sym, rows, cols, monkeypatch):
    _select(isa, monkeypatch)
    for sd in (BF, F16, F32) if (group, sym) == (32, False) else (BF,):
        qt = _table(4, group, sym, rows, cols, sd)
        p = PreparedTable.from_table(qt)
        gen = torch.Generator().manual_seed(cols)
        for m, dt in itertools.product(MS, (BF, F16, F32)):
            x = torch.randn(m, cols, generator=gen) * torch.exp(2 * torch.randn(1, cols, generator=gen))
            x[0, :32] = 0  # an all-zero block: d = 0
            _check(p, qt, x.to(dt), A8[isa].kernel)


@pytest.mark.parametrize("isa", sorted(A8))
def test_int8_activations_large_batch(isa, monkeypatch):
    """M = 256 (every m-tile remainder) over a table of several thousand rows."""
    _select(isa, monkeypatch)
    qt = _table(4, 64, False, 2000, 320, BF)
    p = PreparedTable.from_table(qt)
    x = torch.randn(257, 320, generator=torch.Generator().manual_seed(5))
    for dt in (F32, BF):
        _check(p, qt, x.to(dt), A8[isa].kernel)


@pytest.mark.parametrize("isa", sorted(A8))
def test_int8_codes_are_actquants(isa, monkeypatch):
    """The C kernel rounds each activation to the very code actquant gives: a table whose
    row r is column r's unit vector returns (q_r c_r d) s_r, float32, one rounding each."""
    _select(isa, monkeypatch)
    from embedq.format.codec import QuantizedTable
    from embedq.format.scheme import Scheme
    from embedq.quant.rtn import quantize_rtn
    K = 192
    codes, s, zp = quantize_rtn(torch.eye(K), Scheme(bits=4, symmetric=True, group_size=32), F32)
    qt = QuantizedTable.from_codes(codes, s, zp, 4, 32)
    p = PreparedTable.from_table(qt)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, K, generator=gen) * 10.0 ** torch.randint(-3, 4, (1, K), generator=gen)
    x[1, 5] = x[1, 4] = 0.5 * x[1, :32].abs().max()  # exact halves after scaling land on ties
    got = p.linear(x)
    assert p.last_kernel == A8[isa].kernel
    q, d = actquant.quantize(x)
    c = qt.codes().diagonal().float()  # row r's one nonzero code, at column r
    sr = qt.scale.float()[torch.arange(K), torch.arange(K) // 32]
    dcol = d.repeat_interleave(actquant.BLOCK, 1)
    want = (q.float() * c * dcol) * sr  # float32: the kernel's two roundings
    assert torch.equal(got, want), (got - want).abs().max()


def test_amx_cpus_stay_exact_under_the_opt_in(monkeypatch):
    """On an AMX CPU the exact kernels are faster than int8 activations at every M: under
    EMBEDQ_ACTIVATIONS=int8 they keep serving (the VNNI planes at M = 1, the tiles from M = 2
    for bfloat16 and from M = 16 for float16/float32), exactly; float32 at M = 2-15 takes an
    int8 row; without AMX the int8 rows serve every M."""
    from embedq.kernels import native_head
    why = native_head.AMX_LIB.unavailable() or dispatch.isa_unavailable("avx512vnni")
    if why is not None:
        pytest.skip(why)
    monkeypatch.setenv("EMBEDQ_ACTIVATIONS", "int8")
    qt = _table(4, 32, False, 1001, 96, BF)
    p = PreparedTable.from_table(qt)
    gen = torch.Generator().manual_seed(3)
    for m, dt, kernel in ((1, BF, "native_avx512vnni"), (1, F32, "native_avx512vnni"), (2, BF, "native_amx"),
                          (8, BF, "native_amx"), (15, BF, "native_amx"), (16, F32, "native_amx"),
                          (64, BF, "native_amx"), (8, F32, None)):
        x = torch.randn(m, 96, generator=gen).to(dt)
        if kernel is None:
            _check(p, qt, x, next(r.kernel for r in p.routes if r.act == "int8"))
        else:
            _check_linear(p, qt, x, _wabs(qt))
            assert p.last_kernel == kernel, (m, dt, p.last_kernel)
    assert "native_amx for bfloat16/float16/float32 at M >= 16" in p.variants()
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", "-amx_bf16,-amx_tile")
    p = PreparedTable.from_table(qt)
    for m in (1, 8, 64):
        _check(p, qt, torch.randn(m, 96, generator=gen).to(BF), next(r.kernel for r in p.routes if r.act == "int8"))


def test_opt_in_only_and_only_where_it_fits(monkeypatch):
    """Without EMBEDQ_ACTIVATIONS the exact kernels serve; with it, 8-bit tables, 4-bit per
    row and groups that are not 32k stay exact; a bad value is refused with its name."""
    if dispatch.layout_unavailable("native"):
        pytest.skip(dispatch.layout_unavailable("native"))
    x = torch.randn(1, 192)
    monkeypatch.delenv("EMBEDQ_ACTIVATIONS", raising=False)
    p = PreparedTable.from_table(_table(4, 32, True, 100, 192, BF))
    p.linear(x)
    assert not p.last_kernel.endswith("_a8")
    monkeypatch.setenv("EMBEDQ_ACTIVATIONS", "int8")
    for bits, group, why in ((8, 32, "8-bit"), (8, None, "8-bit"), (4, None, "per-row"), (4, 16, "group 16")):
        p = PreparedTable.from_table(_table(bits, group, True, 100, 192, BF))
        p.linear(x)
        assert p.kind == "native" and not p.last_kernel.endswith("_a8"), (bits, group, p.last_kernel)
        assert "int8 activations not used: " in p.variants() and why in p.variants(), p.variants()
    monkeypatch.setenv("EMBEDQ_ACTIVATIONS", "fp8")
    with pytest.raises(ValueError, match="EMBEDQ_ACTIVATIONS=fp8"):
        PreparedTable.from_table(_table(4, 32, True, 100, 192, BF))


def test_non_finite_activations_take_the_exact_kernel(monkeypatch):
    isa = next((i for i in ("avx2", "portable") if dispatch.isa_unavailable(i) is None), None)
    if isa is None:
        pytest.skip("no native variant here")
    _select(isa, monkeypatch)
    qt = _table(4, 32, True, 100, 96, BF)
    p = PreparedTable.from_table(qt)
    x = torch.randn(2, 96)
    x[1, 3] = float("inf")
    got = p.linear(x)
    monkeypatch.setenv("EMBEDQ_ACTIVATIONS", "exact")
    want = PreparedTable.from_table(qt).linear(x)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    fin = want.isfinite()
    assert torch.equal(got[fin], want[fin])


@pytest.mark.parametrize("build", ["avx512f_simde", "avx2vnni_simde", "avx2vnni", "avx512f"])
def test_other_builds_equal_avx2_bit_for_bit(build, monkeypatch):
    """The avx512f row's int8 path is the AVX2 code compiled in the AVX-512F build, and the
    avx2vnni row's a body of its own (vpdpbusd) with the same int32 sums: each equals the AVX2
    build bit for bit, every grouping. Where no such CPU is at hand, the source is built over
    SIMDe (compiled for AVX2: the real builds' own compiler choices need the real CPU)."""
    from embedq.kernels import native_f32
    from tests.perf.test_cpu_variants import _emulated
    if build in ("avx2vnni", "avx512f"):
        if dispatch.isa_unavailable(build):
            pytest.skip(f"{dispatch.isa_unavailable(build)} (the SIMDe case runs its source)")
        lib = native_f32.VARIANTS[build]
    else:
        lib = _emulated(avx512=build.startswith("avx512f"), vnni=build.startswith("avx2vnni"))
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", SELECT["avx2" if build.endswith("_simde") else build])
    for group, sym, rows, cols in SCHEMES:
        qt = _table(4, group, sym, rows, cols, BF)
        L = PreparedTable.from_table(qt).layout
        sp = L.spec
        gen = torch.Generator().manual_seed(cols)
        for m, dt in itertools.product((1, 3, 17), (BF, F32)):
            x = torch.randn(m, cols, generator=gen).to(dt)
            args = (L.w, L.s, L.z, sp.rows, sp.cols, sp.group, x)
            assert torch.equal(native_f32.head_a8(lib, *args), native_f32.head_a8(native_f32.VARIANTS["avx2"], *args))


@pytest.mark.parametrize("build", ["avx512vnni", "avx512vnni_simde"])
def test_vnni_sixteen_row_pass_equals_avx2_bit_for_bit(build, monkeypatch):
    """The AVX512-VNNI build decodes a block's codes once for 16 activation rows
    (a8_block_vnni16) and once per 8 for the rest: its 16-row pass equals the same rows run
    8 at a time bit for bit (rows are independent), and every M equals the AVX2 build (the
    asymmetric groups' activation sums rounded product by product in every build: fused where
    the target had FMA, they differed in the last bits at g = 128). Where the CPU lacks
    AVX512-VNNI the same source is built over SIMDe."""
    if build == "avx512vnni":
        if dispatch.isa_unavailable("avx512vnni"):
            pytest.skip(f"{dispatch.isa_unavailable('avx512vnni')} (the SIMDe case runs its source)")
        vnni = native_f32.A8_VARIANTS["avx512vnni"]
    else:
        from tests.perf.test_cpu_variants import _emulated
        vnni = _emulated(avx512=True, vnni=True)
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", SELECT["avx512vnni" if build == "avx512vnni" else "avx2"])
    avx2 = native_f32.VARIANTS["avx2"]
    for group, sym, rows, cols in SCHEMES:
        qt = _table(4, group, sym, rows, cols, BF)
        L = PreparedTable.from_table(qt).layout
        sp = L.spec
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(49, cols, generator=gen) * torch.exp(2 * torch.randn(1, cols, generator=gen))
        x[3, :32] = 0  # an all-zero block in a 16-row pass
        for m, dt in itertools.product((8, 15, 16, 17, 24, 32, 49), (BF, F32)):
            xm = x[:m].to(dt)
            got = native_f32.head_a8(vnni, L.w, L.s, L.z, sp.rows, sp.cols, sp.group, xm)
            want = native_f32.head_a8(avx2, L.w, L.s, L.z, sp.rows, sp.cols, sp.group, xm)
            assert torch.equal(got, want), (group, sym, m, dt)
            if m >= 16:  # rows are independent: the 16-row pass equals its rows run 8 at a time
                parts = [native_f32.head_a8(vnni, L.w, L.s, L.z, sp.rows, sp.cols, sp.group, xm[a:a + 8])
                         for a in range(0, 16, 8)]
                assert torch.equal(got[:16], torch.cat(parts)), (group, sym, m, dt)


def test_transformers_load_opt_in(model_factory, monkeypatch):
    """``embedq.load(path, activations="int8")`` (no environment): the tied 4-bit head runs
    the int8 row and equals actquant's activations times the table; logits of the same
    model loaded exact differ only by that rounding; a bad value is one OverlayError line."""
    import embedq
    from embedq.errors import OverlayError
    if dispatch.layout_unavailable("native"):
        pytest.skip(dispatch.layout_unavailable("native"))
    monkeypatch.delenv("EMBEDQ_ACTIVATIONS", raising=False)
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", "-amx_bf16,-amx_tile")  # AMX CPUs stay exact (test above)
    path = model_factory("qwen2_tied")
    embedq.quantize(path, bits=4, progress=False)
    ids = torch.tensor([[1, 5, 7, 300, 2]])
    exact = embedq.load(path).eval()
    a8 = embedq.load(path, activations="int8").eval()
    head = a8.get_output_embeddings()
    assert head.table.prepared is a8.get_input_embeddings().table.prepared  # tied: one table
    with torch.no_grad():
        h = a8.model(ids).last_hidden_state[0]
        got = a8(ids).logits[0]
        assert head.table.prepared.last_kernel.endswith("_a8")
        want = exact(ids).logits[0]
        assert not exact.get_output_embeddings().table.prepared.last_kernel.endswith("_a8")
    q, d = actquant.quantize(h)
    W = head.table.prepared.dequantize_range(0, head.table.prepared.rows, F32).double()
    ref = actquant.dequantize(q, d).double() @ W.t()
    a = actquant.dequantize(q, d).double().abs() @ W.abs().t()
    assert ((got.double() - ref).abs() <= (2 * U[got.dtype] + h.shape[-1] * 2.0 ** -24) * a + 1e-30).all()
    assert (got.float() - want.float()).abs().max() > 0  # the rounding shows, exact stays exact
    with pytest.raises(OverlayError, match="activations='int4'"):
        embedq.load(path, activations="int4")
