"""Every CPU variant of the native kernels this CPU can run, against the reference decoder.

Variants are selected as users' CPUs would select them: ``EMBEDQ_CPU_FEATURES`` takes
features away before the table is prepared (``-avx512_bf16``: the AVX2 build;
``none``: the portable C build), and the test asserts which kernel ran (no silent
fallback to the chunked reference). A variant the hardware cannot run is skipped with the
feature it lacks; the AVX512-BF16 kernel's own cases are in ``test_fastpath.py`` and
``test_fastpath_x86.py``.

Bound (derived as in ``fastpathutil.py``, checked by its ``_check_linear``): the AVX2 and
portable kernels decode each weight to the reference's own float32 ``(q - z) * s`` (M > 2)
or apply ``s`` and ``z * sum(x)`` after a float32 dot (AVX2, M <= 2); activations are
converted to float32 exactly. Against ``F.linear(x, W.to(x.dtype))`` the error per output
is then at most the reference's weight rounding to the activation dtype (u*A), the two
output roundings (2u*A), and float32 summation in another order (K * 2^-24 * A, the
zero-point term's and the scale's roundings included: each is one 2^-24 relative rounding
of a partial sum bounded by A), A = |x| @ ((|q| + |z|) * |s|)^T.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from embedq.format.codec import QuantizedTable
from embedq.format.scheme import Scheme
from embedq.kernels import PreparedTable, dispatch
from embedq.kernels import prepared as fastpath
from embedq.kernels.layouts import Native
from embedq.quant.rtn import quantize_rtn
from tests.perf.fastpathutil import _check_linear, _wabs

BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32

# Every native row taking every activation dtype (the AVX512-BF16 row's own cases are in
# test_fastpath.py and test_fastpath_x86.py), and the EMBEDQ_CPU_FEATURES that selects it on
# a CPU that has it: exactly the features its library needs ("none" for the portable
# build). A new CPU family's row is tested here with no edit.
VARIANTS = {r.isa: r for r in dispatch.ROUTES if r.layout is Native and r.lib is not None
            and set(r.acts) >= {BF, F16, F32} and r.act == "exact" and r.m_max is None and r.m_min == 1}
SELECT = {isa: ",".join(r.lib.needs) or "none" for isa, r in VARIANTS.items()}

# (bits, group, sym, rows, cols): vocab never a multiple of the 16-row block (nor of the
# 8-block super-block), odd group counts (3 groups), per-row and every group size
SCHEMES = [(b, g, s, r, c) for (b, s), (g, r, c) in itertools.product(
    itertools.product((8, 4), (True, False)),
    [(None, 1001, 192), (32, 1001, 96), (64, 777, 192), (128, 531, 384)])]
MS = (1, 2, 3, 4, 7, 8, 9, 17, 64)  # 3-8: the direct path in passes of two rows (int8 to 8, 4-bit to 4)
# every scheme with bf16 scales; f16 / f32 scales (their own decode paths) on a subset
CASES = [(sd, *c) for c in SCHEMES for sd in (BF,)] + [
    (sd, *c) for c in SCHEMES if c[2] is False and c[1] in (None, 32) for sd in (F16, F32)]


def _table(bits, group, sym, rows, cols, scale_dtype, seed=0) -> QuantizedTable:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
    w[0] = 0
    w[1] = torch.rand(cols, generator=gen) + 2  # positive only: zero point at qmin
    q, s, zp = quantize_rtn(w, Scheme(bits=bits, symmetric=sym, group_size=group), scale_dtype)
    return QuantizedTable.from_codes(q, s, zp, bits, group)


def _select(variant: str, monkeypatch) -> None:
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", SELECT[variant])
    why = dispatch.isa_unavailable(variant)
    if why is not None:
        pytest.skip(why)
    # the first row left for any M is this variant (rows before it serve small M only)
    assert next(r for r in dispatch.rows_for("native") if r.m_max is None and r.m_min == 1).isa == variant


@pytest.mark.parametrize("variant", sorted(SELECT))
@pytest.mark.parametrize("scale_dtype,bits,group,sym,rows,cols", CASES,
                         ids=[f"int{b}-{'row' if g is None else f'g{g}'}-{'sym' if s else 'asym'}-{r}x{c}-"
                              f"s_{str(sd)[6:]}" for sd, b, g, s, r, c in CASES])
def test_variant_matches_reference(variant, scale_dtype, bits, group, sym, rows, cols, monkeypatch):
    _select(variant, monkeypatch)
    qt = _table(bits, group, sym, rows, cols, scale_dtype)
    p = PreparedTable.from_table(qt)
    assert p.kind == "native", p.describe()
    wabs = _wabs(qt)
    gen = torch.Generator().manual_seed(cols)
    for m, dt in itertools.product(MS, (BF, F16, F32)):
        x = torch.randn(m, cols, generator=gen).to(dt)
        _check_linear(p, qt, x, wabs)
        # this variant's row for (dt, m): its general row, or a row of its own ISA before it
        # that serves this M (e.g. the AVX-512F rows at small M)
        row = next(r for r in dispatch.rows_for("native", p.spec) if dt in r.acts
                   and (r.m_max is None or m <= r.m_max) and m >= r.m_min)
        assert row.isa == variant and p.last_kernel == row.kernel, (p.last_kernel, m, dt)
    # gather from the same buffer: bit-exact
    ids = torch.tensor([0, 1, rows - 1, 17, rows // 2])
    for dt in (BF, F16, F32):
        assert torch.equal(p.embedding(ids, dt), qt.dequantize(dt, rows=ids))


@pytest.mark.parametrize("variant", sorted(SELECT))
def test_variant_large_batch(variant, monkeypatch):
    """M = 256 (every micro-tile and super-block remainder) and a table past one KC chunk."""
    _select(variant, monkeypatch)
    qt = _table(4, 64, False, 2000, 320, BF)
    p = PreparedTable.from_table(qt)
    x = torch.randn(256, 320, generator=torch.Generator().manual_seed(5))
    for dt in (F32, BF):
        _check_linear(p, qt, x.to(dt), _wabs(qt))
        assert p.last_kernel == VARIANTS[variant].kernel


def test_one_info_line_names_the_variant(monkeypatch, capsys):
    """One line per load (not a warning) says which kernel serves which activation dtype."""
    if dispatch.layout_unavailable("native"):
        pytest.skip(dispatch.layout_unavailable("native"))
    fastpath._said.clear()
    qt = _table(8, 32, True, 300, 96, BF)
    PreparedTable.from_table(qt)
    PreparedTable.from_table(qt)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("embedq: ") and "native_" in err[0], err
    assert "warning" not in err[0].lower()


def test_cpu_features_override_picks_the_route(monkeypatch):
    """The route follows the features left: none -> portable; a CPU's own -> its best."""
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", "none")
    if dispatch.isa_unavailable("portable"):
        pytest.skip(dispatch.isa_unavailable("portable"))
    assert [r.isa for r in dispatch.rows_for("native")] == ["portable"]
    assert "CPU lacks avx2" in dispatch.isa_unavailable("avx2") or "not x86" in dispatch.isa_unavailable("avx2")


# --- the AVX-512F source where no AVX-512 CPU is at hand ---------------------------------
# The avx512f row runs only on AVX-512 CPUs (its cases above skip elsewhere). Its source is
# also built over SIMDe's AVX-512 emulation (Debian's libsimde-dev, installed by
# scripts/setup_aarch64.sh with the other kernel-test toolchains) and must equal the AVX2
# build bit for bit: the zmm micro-kernel does each lane's float32 operations in the AVX2
# one's order. So every x86 machine checks the AVX-512 code, and an AVX-512 CPU runs it.
SIMDE_HEADER = "/usr/include/simde/x86/avx512.h"


def _emulated(avx512: bool = True, vnni: bool = False, q4d: bool = False):
    """The AVX-512F source (``avx512``) or the AVX2 one, with the VNNI planes (``vnni``), over
    the 4-bit dword layout (``q4d``), built for AVX2 over SIMDe's emulation of the
    instructions this CPU may lack."""
    import os

    from clients import setup, unavailable
    from embedq.kernels import native_f32
    from embedq.kernels.build import LazyLibrary
    if dispatch.isa_unavailable("avx2"):
        pytest.skip(f"the emulation runs on AVX2: {dispatch.isa_unavailable('avx2')}")
    if not os.path.exists(SIMDE_HEADER):
        setup("scripts/setup_aarch64.sh", "SIMDe (libsimde-dev)")
    if not os.path.exists(SIMDE_HEADER):
        unavailable("SIMDe (libsimde-dev)", f"{SIMDE_HEADER} missing after scripts/setup_aarch64.sh")
    base = native_f32.VARIANTS["avx512f"]
    flags = [f for f in base.flags if not f.startswith("-mavx512")] + ["-Wno-psabi"]
    flags += ["-DEQ_SIMDE"] * avx512 + ["-DEQ_SIMDE_VNNI"] * vnni + ["-DEQ_Q4D"] * q4d
    name = f"head_{'avx512f' if avx512 else 'avx2'}{'_vnni' * vnni}{'_q4d' * q4d}_simde"
    lib = LazyLibrary(name, native_f32._source, flags, needs=("avx2", "fma", "f16c"), machines=base.machines,
                      setup=native_f32._setup, label=f"native head ({name} on SIMDe)")
    assert lib.get() is not None, lib.unavailable()
    return lib


def _emulated_avx512f():
    return _emulated()


@pytest.mark.parametrize("scale_dtype,bits,group,sym,rows,cols", CASES[:8] + CASES[-2:],
                         ids=[f"int{b}-{'row' if g is None else f'g{g}'}-{'sym' if s else 'asym'}-{r}x{c}-"
                              f"s_{str(sd)[6:]}" for sd, b, g, s, r, c in CASES[:8] + CASES[-2:]])
def test_avx512f_source_equals_avx2_bit_for_bit(scale_dtype, bits, group, sym, rows, cols, monkeypatch):
    lib = _emulated_avx512f()
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", SELECT["avx2"])
    _assert_equals_avx2(lib, _table(bits, group, sym, rows, cols, scale_dtype), check=True)


@pytest.mark.parametrize("scale_dtype,bits,group,sym,rows,cols", CASES[:len(SCHEMES)],
                         ids=[f"int{b}-{'row' if g is None else f'g{g}'}-{'sym' if s else 'asym'}-{r}x{c}"
                              for _, b, g, s, r, c in CASES[:len(SCHEMES)]])
def test_avx2vnni_source_equals_avx2_bit_for_bit(scale_dtype, bits, group, sym, rows, cols, monkeypatch):
    """The avx2vnni row (Alder Lake and later, Sierra Forest, Zen 5) where no AVX-VNNI CPU is
    at hand: its source over SIMDe's vpdpwssd / vpdpbusd equals the AVX2 build bit for bit at
    every M and activation dtype (its test_variant_matches_reference cases skip here), and
    meets the reference at M = 3 and 17. An AVX-VNNI CPU runs the real build above too."""
    lib = _emulated(avx512=False, vnni=True)
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", SELECT["avx2"])
    _assert_equals_avx2(lib, _table(bits, group, sym, rows, cols, scale_dtype), check=True)


def _assert_equals_avx2(lib, qt, check: bool = False) -> None:
    """``lib``'s output equals the AVX2 build's bit for bit at every M and activation dtype
    (``check``: and the reference bound at M = 3 and 17)."""
    from embedq.kernels import native_f32
    p = PreparedTable.from_table(qt)
    assert p.kind == "native", p.describe()
    L, sp = p.layout, p.layout.spec
    gen = torch.Generator().manual_seed(sp.cols)
    for m, dt in itertools.product(MS + (256,), (BF, F16, F32)):
        x = torch.randn(m, sp.cols, generator=gen).to(dt)
        args = (L.w, L.s, L.z, sp.bits, sp.rows, sp.cols, sp.group, x)
        got = native_f32.head(lib, *args)
        assert torch.equal(got, native_f32.head(native_f32.VARIANTS["avx2"], *args)), (m, dt)
        if check and m in (3, 17):
            _check_linear_result(qt, x, got)


@pytest.mark.parametrize("scale_dtype,bits,group,sym,rows,cols", CASES[:len(SCHEMES)],
                         ids=[f"int{b}-{'row' if g is None else f'g{g}'}-{'sym' if s else 'asym'}-{r}x{c}"
                              for _, b, g, s, r, c in CASES[:len(SCHEMES)]])
def test_avx512f_build_equals_avx2_bit_for_bit(scale_dtype, bits, group, sym, rows, cols, monkeypatch):
    """The real AVX-512F build (its zmm tile decode is not in the SIMDe build) against the
    AVX2 build, every M path: the same float32 operations per lane, the same bits."""
    from embedq.kernels import native_f32
    lib = native_f32.VARIANTS["avx512f"]
    if lib.unavailable():
        pytest.skip(lib.unavailable())
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "native")  # both builds read this layout
    _assert_equals_avx2(lib, _table(bits, group, sym, rows, cols, scale_dtype))


def _check_linear_result(qt, x, got):
    """The emulated output against the reference at the bound of this file's docstring."""
    class _Fixed:  # _check_linear calls p.linear(x); hand it this result
        def linear(self, x):
            return got

        def describe(self):
            return "native_avx512f (SIMDe)"
    _check_linear(_Fixed(), qt, x, _wabs(qt))


# --- the thread fan-out (eq_parallel.h) ------------------------------------------------------
def test_fanout_runs_on_torchs_openmp_and_pthreads_agree(monkeypatch):
    """The head kernels fan out on torch's own OpenMP team (one libgomp in the process: the
    library's DT_NEEDED libgomp.so.1 resolves to the one torch loaded), and a build without
    OpenMP (the pthread fan-out, for compilers that lack it) gives the same bits."""
    import os
    from embedq.kernels import native_f32
    from embedq.kernels.build import LazyLibrary
    isa = next((r.isa for r in dispatch.rows_for("native") if r.isa in native_f32.VARIANTS), None)
    if isa not in native_f32.VARIANTS:
        pytest.skip(f"no native_f32 build runs here ({dispatch.layout_unavailable('native')})")
    omp = native_f32.VARIANTS[isa]
    assert omp.openmp and omp.get() is not None, omp.unavailable()
    assert b"GOMP_parallel" in open(omp.get()._name, "rb").read(), "built without OpenMP"
    # one libgomp.so.1 (the soname torch and the kernel link): torch's; vendored renamed
    # copies of other wheels (scikit-learn's libgomp-<hash>.so) serve only their own package
    maps = {line.split()[-1] for line in open(f"/proc/{os.getpid()}/maps")
            if os.path.basename(line.split()[-1]) == "libgomp.so.1"}
    assert len(maps) == 1, f"two libgomp.so.1 in one process: {sorted(maps)}"
    plain = LazyLibrary(f"{omp.name}_pthread", native_f32._source, omp.flags, needs=omp.needs,
                        machines=omp.machines, setup=native_f32._setup, label=f"{omp.label} (pthreads)")
    assert plain.get() is not None, plain.unavailable()
    assert b"GOMP_parallel" not in open(plain.get()._name, "rb").read()
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", SELECT[isa])
    for bits, group, sym in ((8, 64, True), (4, 32, False)):
        qt = _table(bits, group, sym, 1001, 192, BF)
        p = PreparedTable.from_table(qt)
        L, sp = p.layout, p.layout.spec
        for m, dt, threads in itertools.product((1, 3, 17), (BF, F32), (1, 2, 3)):
            x = torch.randn(m, sp.cols, generator=torch.Generator().manual_seed(m)).to(dt)
            args = (L.w, L.s, L.z, sp.bits, sp.rows, sp.cols, sp.group, x)
            old = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                assert torch.equal(native_f32.head(omp, *args), native_f32.head(plain, *args)), (bits, m, dt)
            finally:
                torch.set_num_threads(old)


def test_failed_openmp_build_is_remembered(tmp_path, monkeypatch):
    """A compiler without OpenMP: the library falls back to its pthread build, and the
    failed -fopenmp compile is kept in the kernel cache, so the next process (a new
    LazyLibrary) does not pay for it again."""
    import subprocess
    from embedq.kernels import build
    if build.compiler() is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("EMBEDQ_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "OPENMP", ["-fembedq-no-such-openmp-flag"])  # any compile error
    calls = []
    real = subprocess.run
    monkeypatch.setattr(build.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or real(cmd, **kw))
    src = "int eq_answer(void) { return 42; }\n"
    for attempt in (1, 2):
        lib = build.LazyLibrary("remember_test", src, ["-O2", "-shared", "-fPIC"], openmp=True)
        assert lib.get() is not None and lib.get().eq_answer() == 42, lib.unavailable()
        tried = [c for c in calls if "-fembedq-no-such-openmp-flag" in c]
        assert len(tried) == 1, (attempt, calls)  # compiled once, then read from the cache
    assert [p.suffix for p in tmp_path.iterdir()].count(".failed") == 1


# --- 4-bit at M == 1: integer dot products over exact int16 activation planes -------------------
def _wide(cols: int, seed: int) -> torch.Tensor:
    """bf16 activations over a huge exponent range (2^-130 .. 2^30: bf16 subnormals
    included), zeros and both signs: a group then needs several planes."""
    gen = torch.Generator().manual_seed(seed)
    e = torch.randint(-130, 31, (1, cols), generator=gen).float()  # norms stay finite
    x = torch.randn(1, cols, generator=gen) * torch.exp2(e)
    x[0, ::7] = 0
    x[0, 3] = 2.0 ** -133  # the smallest bf16 subnormal
    return x.to(BF)


# the rows serving 4-bit at M = 1 from a native_f32 build (AVX2 and AVX-512, with and without
# VNNI): each is selected by exactly its library's features
Q4_ONE_ROW = {r.isa: r for r in dispatch.ROUTES if r.layout is Native and 4 in r.bits and r.act == "exact"
              and r.lib is not None and r.lib.name.startswith("head_avx") and r.m_min == 1}


@pytest.mark.parametrize("variant", sorted(Q4_ONE_ROW))
# 8, 16: step counts (columns / 4) that the kernels do not unroll
@pytest.mark.parametrize("group,sym", [(32, True), (32, False), (64, True), (64, False), (8, False), (16, True)])
def test_q4_one_row_integer_planes(variant, group, sym, monkeypatch):
    """eq_q4planes.h: bf16 / f16 activations of one row are split into planes of exact
    int16 values over one power of two per group; the kernel's integer sums equal the
    reference at the derived bound, however many planes the exponent range needs, and the
    VNNI builds' (vpdpwssd) equal the AVX2 build's bit for bit. A float32 row with more than
    15 significant bits takes the float path (0 planes)."""
    from embedq.kernels import native_f32
    row = Q4_ONE_ROW[variant]
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", ",".join(row.lib.needs))
    if dispatch.isa_unavailable(variant) or dispatch.isa_unavailable("avx2"):
        pytest.skip(dispatch.isa_unavailable(variant) or dispatch.isa_unavailable("avx2"))
    lib = row.lib.get()
    qt = _table(4, group, sym, 777, 192, BF)
    p = PreparedTable.from_table(qt)
    L, sp = p.layout, p.layout.spec
    wabs = _wabs(qt)
    gen = torch.Generator().manual_seed(group)
    rows = [("randn bf16", torch.randn(1, 192, generator=gen).to(BF)),
            ("randn f16", torch.randn(1, 192, generator=gen).to(F16)),
            ("wide bf16", _wide(192, 1)), ("wide bf16 2", _wide(192, 2)),
            ("bf16 held as f32", torch.randn(1, 192, generator=gen).to(BF).to(F32))]
    for name, x in rows:
        xf = x.float().contiguous()
        planes = lib.head_f32_planes(xf.data_ptr(), 192, group, 4)
        assert planes >= 192 // group, (name, planes)
        if name.startswith("wide"):
            assert planes > 3 * 192 // group, (name, planes)  # many planes per group
        _check_linear(p, qt, x, wabs)
        assert p.last_kernel == row.kernel, (p.last_kernel, name)
        args = (L.w, L.s, L.z, sp.bits, sp.rows, sp.cols, sp.group, x)
        assert torch.equal(native_f32.head(row.lib, *args), native_f32.head(native_f32.VARIANTS["avx2"], *args)), name
    xf = torch.randn(1, 192, generator=gen)
    assert lib.head_f32_planes(xf.data_ptr(), 192, group, 4) == 0  # 24-bit values: float path
    _check_linear(p, qt, xf, wabs)
    inf = xf.to(BF).float().clone()
    inf[0, 5] = float("inf")
    assert lib.head_f32_planes(inf.data_ptr(), 192, group, 4) == 0


# --- int8 at M == 1: the same planes (eq_i8planes.h), chunks of <= 64 columns ------------------
def _f32_builds():
    from embedq.kernels import native_f32
    return {**native_f32.VARIANTS, **native_f32.A8_VARIANTS}


@pytest.mark.parametrize("build", ["avx2", "avx2vnni", "avx2vnni_simde", "avx512f", "avx512vnni"])
@pytest.mark.parametrize("group,sym,cols", [(None, True, 192), (None, False, 200), (32, False, 96), (64, True, 192),
                                            (128, False, 384)])
def test_i8_one_row_integer_planes(build, group, sym, cols, monkeypatch):
    """eq_i8planes.h: one activation row's chunks (<= 64 columns, dividing the group; per-row
    tables too) split into exact int16 planes; int8 codes widened to int16 meet them in
    vpmaddwd / vpdpwssd. Every build gives the AVX2 build's bits, the reference's values at the
    derived bound however many planes the exponents need; a float32 row with more than 15
    significant bits, or an inf, takes the float path (0 planes) and still meets the bound.
    ``avx2vnni_simde``: the avx2vnni source over SIMDe's vpdpwssd, on any AVX2 CPU."""
    from embedq.kernels import native_f32
    lib = _emulated(avx512=False, vnni=True) if build == "avx2vnni_simde" else _f32_builds()[build]
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", ",".join(lib.needs))
    why = lib.unavailable() or dispatch.isa_unavailable("avx2")
    if why:
        pytest.skip(why)
    so, avx2 = lib.get(), native_f32.VARIANTS["avx2"]
    qt = _table(8, group, sym, 777, cols, BF)
    p = PreparedTable.from_table(qt)
    L, sp = p.layout, p.layout.spec
    wabs = _wabs(qt)
    gen = torch.Generator().manual_seed(cols)
    chunks = cols // next(c for c in (64, 32, 16, 8, 4, 2) if sp.group % c == 0)
    xs = [("randn bf16", torch.randn(1, cols, generator=gen).to(BF)),
          ("randn f16", torch.randn(1, cols, generator=gen).to(F16)),
          ("wide bf16", _wide(cols, 1)), ("wide bf16 2", _wide(cols, 2)),
          ("bf16 held as f32", torch.randn(1, cols, generator=gen).to(BF).to(F32))]
    full = torch.randn(1, cols, generator=gen)
    inf = full.to(BF).float().clone()
    inf[0, 5] = float("inf")
    for name, x in xs + [("24-bit f32", full), ("inf", inf)]:
        xf = x.float().contiguous()
        planes = so.head_f32_planes(xf.data_ptr(), cols, sp.group, 8)
        if name in ("24-bit f32", "inf"):
            assert planes == 0, (name, planes)
        else:
            assert planes >= chunks, (name, planes)
            if name.startswith("wide"):
                assert planes > 3 * chunks, (name, planes)  # many planes per chunk
        args = (L.w, L.s, L.z, sp.bits, sp.rows, sp.cols, sp.group, x)
        got = native_f32.head(lib, *args)
        torch.testing.assert_close(got, native_f32.head(avx2, *args), rtol=0, atol=0, equal_nan=True, msg=name)
        if name != "inf":
            _check_linear_result(qt, x, got)


@pytest.mark.parametrize("avx512", [False, True], ids=["avx2vnni", "avx512vnni"])
def test_vnni_planes_on_simde_equal_avx2_bit_for_bit(avx512, monkeypatch):
    """The VNNI planes (vpdpwssd, 256 and 512 bits) on CPUs without VNNI: the same source with
    SIMDe's vpdpwssd gives the AVX2 build's bits at M = 1 (4-bit), every plane count; on a CPU
    with VNNI test_q4_one_row_integer_planes runs the real instructions too."""
    from embedq.kernels import native_f32
    lib = _emulated(avx512=avx512, vnni=True)
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", SELECT["avx2"])
    for group, sym in ((32, True), (64, False), (16, False)):
        qt = _table(4, group, sym, 777, 192, BF)
        p = PreparedTable.from_table(qt)
        L, sp = p.layout, p.layout.spec
        gen = torch.Generator().manual_seed(group)
        for x in (torch.randn(1, 192, generator=gen).to(BF), torch.randn(1, 192, generator=gen).to(F16),
                  _wide(192, 1), _wide(192, 2)):
            args = (L.w, L.s, L.z, sp.bits, sp.rows, sp.cols, sp.group, x)
            got = native_f32.head(lib, *args)
            assert torch.equal(got, native_f32.head(native_f32.VARIANTS["avx2"], *args)), (group, x.dtype)
        _check_linear_result(qt, x, got)
