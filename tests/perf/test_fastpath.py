"""Every fast path of embedq.kernels against the reference (dequantize, then index / F.linear).

Gathers must be bit-exact (same float32 arithmetic as QuantizedTable.dequantize).

Logits cannot be bit-exact: the kernels accumulate in float32 in another order than
F.linear and round differently. The bound used (``_bound``), per output element, with
``u`` the unit roundoff of the activation dtype (2^-8 bf16, 2^-11 fp16, 2^-24 fp32) and
``A = |x| @ ((|q| + |zp|) * s)^T`` (>= |x| @ |W|^T, bounds every partial sum):
  * reference: each weight rounded to the activation dtype (<= u*|w|) -> u*A;
  * fast path: int4 rounds -zp*s to the activation dtype (<= u*|zp*s|); asymmetric int8
    rounds s*(x.q) (or each group's partial) to the activation dtype before the float32
    zero-point correction / group sum -> u*A;
  * one output rounding each side -> 2u*A;
  * float32 accumulation in different orders -> K * 2^-24 * A.
Hence |fast - ref| <= (4u + K*2^-24) * A; the test allows 6u for slack. A second check
bounds the relative Frobenius error by 2u + 2*sqrt(K)*2^-24*|A|/|ref| (typical errors are
random, not worst case: rounding errors of a K-term float32 sum grow like sqrt(K)).
"""

from __future__ import annotations

import itertools
import warnings
from functools import lru_cache

import pytest
import torch
import torch.nn.functional as F

from embedq.kernels import layouts
from embedq.kernels import prepared as fastpath
from embedq.kernels import PreparedTable, dispatch, native_head
from embedq.quant.rtn import quantize_rtn
from embedq.format.scheme import Scheme
from embedq.format.codec import QuantizedTable

BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
U = {BF: 2.0 ** -8, F16: 2.0 ** -11, F32: 2.0 ** -24}

# (rows, cols): vocab sizes not divisible by any kernel tile; cols=96 gives odd group counts
SHAPES = [(1000, 256), (4097, 96)]
SCHEMES = [(b, g, s) for b, g, s in itertools.product((8, 4), (None, 32, 64, 128), (True, False))]
CASES = [(b, g, s, shape) for (b, g, s), shape in itertools.product(SCHEMES, SHAPES)
         if g is None or shape[1] % g == 0]


@lru_cache(maxsize=None)
def _table(bits, group, sym, rows, cols, scale_dtype=BF, seed=0) -> QuantizedTable:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
    w[0] = 0  # all-zero row: scale 1, code 0
    w[1] = torch.rand(cols, generator=gen) + 2  # positive only: zero point at qmin
    q, s, zp = quantize_rtn(w, Scheme(bits=bits, symmetric=sym, group_size=group), scale_dtype)
    return QuantizedTable.from_codes(q, s, zp, bits, group)


def _wabs(qt: QuantizedTable) -> torch.Tensor:
    q = qt.codes().float().abs()
    zp = torch.zeros_like(qt.scale, dtype=torch.float32) if qt.zero_point is None else qt.zero_point.float().abs()
    g = qt.cols if qt.group_size is None else qt.group_size
    qg = q.reshape(qt.rows, -1, g) + zp.unsqueeze(-1)
    # |scale|: 4-bit sym (signed-max) scales may be negative
    return (qg * qt.scale.float().abs().unsqueeze(-1)).reshape(qt.rows, qt.cols)


def _reference(qt: QuantizedTable, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, qt.dequantize(F32).to(x.dtype))


def _bound(qt: QuantizedTable, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The derived per-logit bound of an exact kernel against the reference (a = |x| @ |W|^T)."""
    return (6 * U[x.dtype] + qt.cols * 2.0 ** -24) * a + 1e-30


def _check_linear(p: PreparedTable, qt: QuantizedTable, x: torch.Tensor, wabs: torch.Tensor) -> None:
    got = p.linear(x)
    ref = _reference(qt, x)
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], qt.rows)
    u, k = U[x.dtype], qt.cols
    a = x.float().abs() @ wabs.t()
    err = (got.float() - ref.float()).abs()
    bound = _bound(qt, x, a)
    worst = (err / bound).max().item()
    assert worst <= 1, f"{p.describe()} {x.dtype} {tuple(x.shape)}: error {worst:.2f}x the bound"
    # typical (random-walk) summation error: ~sqrt(K) * 2^-24 * |A| per element; 2x slack
    rnorm = ref.float().norm().clamp_min(1e-30)
    rel = (err.norm() / rnorm).item()
    lim = 2 * u + 2 * k ** 0.5 * 2.0 ** -24 * (a.norm() / rnorm).item()
    assert rel <= lim, f"{p.describe()} {x.dtype}: relative error {rel:.3g} > {lim:.3g}"


def _xs(cols: int, seed: int = 1, full: bool = True):
    """Activations: M in {1, 2, 3, 8, 10, 16, 17, 64, 256} (every tile remainder and small-M switch of
    the native kernels), a 3-D batch and a vector; ``full=False``: M in {1, 3, 64} (torch's
    fallback ops)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((1, cols), (3, cols), (8, cols), (17, cols), (64, cols), (2, 5, cols), (cols,), (2, cols),
              (256, cols), (16, cols))  # 10-16: native_bf16's 16-row tile of groups in registers
    for shape in shapes if full else shapes[:2] + shapes[4:7]:
        x = torch.randn(*shape, generator=gen)
        for dt in (BF, F16, F32):
            yield x.to(dt)


@pytest.fixture
def torch_layouts(monkeypatch):
    """Only torch's weight-only layouts (the fallbacks where the native kernel cannot run)."""
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "torch")


NATIVE = native_head.unavailable() is None  # the AVX512-BF16 kernel
# The native layout runs wherever one of its C variants does (AVX512-BF16, AVX2, portable);
# each act dtype and M then has the first variant of dispatch.rows_for("native") that takes it
# (bf16 at small M: the AVX-512F rows before the AVX512-BF16 one).
NATIVE_LAYOUT = dispatch.layout_unavailable("native") is None


def _native_kernel(dt, spec, m: int) -> str:
    """The native variant this CPU serves ``m`` activation rows of ``dt`` with for a table of
    ``spec`` (no silent fallback)."""
    return next(r.kernel for r in dispatch.rows_for("native", spec) if dt in r.acts
                and (r.m_max is None or m <= r.m_max) and m >= r.m_min)


@pytest.mark.parametrize("serve", ["native", "torch"])
@pytest.mark.parametrize("bits,group,sym,shape", CASES,
                         ids=[f"int{b}-{'row' if g is None else f'g{g}'}-{'sym' if s else 'asym'}-{r}x{c}"
                              for b, g, s, (r, c) in CASES])
def test_fast_path_matches_reference(bits, group, sym, shape, serve, monkeypatch):
    if serve == "native" and not NATIVE_LAYOUT:
        pytest.skip(f"no native variant here: {dispatch.layout_unavailable('native')}")
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", serve)
    qt = _table(bits, group, sym, *shape)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every scheme here has this fast path: no fallback warning
        p = PreparedTable.from_table(qt)
    expected = {8: "int8_row" if group is None else "int8_group", 4: "int4_cpu"}[bits]
    if bits == 4 and fastpath._int4_layout() is None:  # pragma: no cover - exotic CPU
        expected = "chunked"
    if serve == "native":
        expected = "native"
    assert p.kind == expected, p.describe()
    # memory: the quantized size (int4: + the kernel's interleaved scale/zero pairs and row padding)
    assert p.nbytes <= qt.nbytes() * 1.3 + 64 * qt.cols, (p.nbytes, qt.nbytes())
    wabs = _wabs(qt)
    for x in _xs(qt.cols, full=serve == "native"):
        _check_linear(p, qt, x, wabs)
        if serve == "native":  # the variant this CPU has ran, not the chunked reference
            m = x.reshape(-1, qt.cols).shape[0]
            assert p.last_kernel == _native_kernel(x.dtype, p.spec, m), (p.last_kernel, x.dtype, m)
    ids = torch.tensor([[0, 1, qt.rows - 1], [63, 64, 5]])
    for dt in (BF, F16, F32):
        got = p.embedding(ids, dt)
        assert got.shape == (2, 3, qt.cols)
        assert torch.equal(got, qt.dequantize(dt, rows=ids.reshape(-1)).view(2, 3, -1))
    every = torch.arange(qt.rows)
    for dt in (BF, F16, F32):
        assert torch.equal(p.embedding(every, dt), qt.dequantize(dt))
    if serve == "native":  # the C gather (gather_rows) served those, not the torch reference
        assert p.layout.gather(ids, BF) is not None
    for bad in (qt.rows, -1):  # as nn.Embedding: an error, not a padding or a wrapped row
        with pytest.raises(IndexError):
            p.embedding(torch.tensor([bad]), F32)
    for dt in (BF, F16, F32):  # the block decoder of the chunked logits, incl. its 16-bit shortcut
        assert torch.equal(p.dequantize_range(0, qt.rows, dt), qt.dequantize(dt))
        assert torch.equal(p.dequantize_range(65, 130, dt), qt.dequantize(dt, rows=slice(65, 130)))


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


@pytest.mark.parametrize("bits,group,sym", [(8, None, False), (8, 32, True), (4, 32, False), (4, None, True)])
def test_chunked_fallback_matches_reference(bits, group, sym, monkeypatch):
    """The fallback (and the fast paths' load-time conversion) with chunks much smaller than the table."""
    monkeypatch.setattr(layouts, "CHUNK_ELEMS", 96 * 100)
    qt = _table(bits, group, sym, 4097, 96)
    wabs = _wabs(qt)
    for prefer in ("chunked", None):
        p = PreparedTable.from_table(qt, prefer=prefer)
        assert (p.kind == "chunked") == (prefer == "chunked")
        for x in _xs(96, seed=3):
            _check_linear(p, qt, x, wabs)
        assert torch.equal(p.embedding(torch.arange(qt.rows), F32), qt.dequantize(F32))
        assert torch.equal(p.dequantize_range(0, qt.rows, BF), qt.dequantize(BF))


def test_native_is_the_default_layout_on_this_cpu():
    """Wherever a native variant runs (a C compiler), every scheme the tests use prepares the
    native layout (one buffer) and every activation dtype gets a C kernel, not chunked."""
    if not NATIVE_LAYOUT:
        pytest.skip(f"no native variant here: {dispatch.layout_unavailable('native')}")
    for bits, group, sym in SCHEMES:
        p = PreparedTable.from_table(_table(bits, group, sym, 1000, 256))
        assert p.kind == "native"
        for dt in (BF, F16, F32):
            assert p.kernel_for(torch.zeros(3, 256, dtype=dt)).startswith("native_")


@pytest.mark.parametrize("serve", ["native", "torch"])
def test_tied_one_buffer_from_overlay_tensors(serve, monkeypatch):
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", serve)
    """What a back end holds (packed zero points along rows): one object serves gather and head."""
    qt = _table(4, 32, False, 1000, 256)
    p = PreparedTable.from_packed(qt.packed, qt.scale, qt.cols, qt.bits, qt.group_size,
                                  zero_point_packed=qt.packed_zero_point())
    assert p.kind == ("int4_cpu" if serve == "torch" else "native" if NATIVE_LAYOUT else "chunked")
    ids = torch.tensor([3, 999, 0])
    assert torch.equal(p.embedding(ids, BF), qt.dequantize(BF, rows=ids))
    x = torch.randn(2, 256, dtype=BF)
    _check_linear(p, qt, x, _wabs(qt))
    # the head of a tied model is the embedding's rows: logits of row i's own vector
    emb = p.embedding(ids, F32)
    assert torch.allclose(p.linear(emb)[torch.arange(3), ids], (emb * emb).sum(-1), rtol=1e-5)


@pytest.mark.parametrize("bits,group,cols,why", [
    (4, 16, 96, "groups of 16"),
    (8, None, 100, "multiples of 16"),
    (8, 8, 96, "multiples of 16"),
])
def test_unsupported_scheme_falls_back_with_one_warning(bits, group, cols, why, torch_layouts):
    fastpath._warned.clear()
    qt = _table(bits, group, True, 300, cols)
    with pytest.warns(RuntimeWarning, match=why):
        p = PreparedTable.from_table(qt)
    assert p.kind == "chunked" and why in p.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        PreparedTable.from_table(qt)
    for x in _xs(cols):
        _check_linear(p, qt, x, _wabs(qt))
    assert torch.equal(p.embedding(torch.arange(300), BF), qt.dequantize(BF))


def test_int4_scales_not_exact_in_activation_dtype_fall_back(torch_layouts):
    fastpath._warned.clear()
    qt = _table(4, 32, True, 200, 64, scale_dtype=F32)
    with pytest.warns(RuntimeWarning, match="not exact"):
        p = PreparedTable.from_table(qt, dtype=BF)
    assert p.kind == "chunked"
    # float32 activations/scales: the int4 layout is used (scales exact in float32)
    p32 = PreparedTable.from_table(qt, dtype=F32)
    assert p32.kind == "int4_cpu"
    for x in _xs(64):
        _check_linear(p32, qt, x, _wabs(qt))
    assert torch.equal(p32.embedding(torch.arange(200), F32), qt.dequantize(F32))


def test_int4_large_group_uses_kernel_groups(torch_layouts):
    """Per-row and groups > 256 repeat their scale over groups the int4 kernel accepts."""
    qt = _table(4, 512, False, 300, 1024)
    p = PreparedTable.from_table(qt)
    assert p.kind == "int4_cpu" and p.layout.kgroup == 256 and p.layout.rep == 2
    for x in _xs(1024):
        _check_linear(p, qt, x, _wabs(qt))
    assert torch.equal(p.embedding(torch.arange(300), F32), qt.dequantize(F32))


@pytest.mark.parametrize("serve", ["native", "torch"])
def test_misaligned_activations(serve, monkeypatch):
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", serve)
    """A view at an odd offset (the int8 kernel uses aligned loads) still works."""
    qt = _table(8, None, True, 1000, 256)
    p = PreparedTable.from_table(qt)
    buf = torch.randn(1 + 3 * 256, dtype=BF)
    x = buf[1:].view(3, 256)
    assert x.data_ptr() % 64
    _check_linear(p, qt, x, _wabs(qt))


@pytest.mark.parametrize("dt", [BF, torch.float16, F32])
@pytest.mark.parametrize("m", [1, 3])
def test_strided_activations_every_dtype(dt, m):
    """The C kernels take x in its own dtype (converted in C): a strided view (every other
    column) and each dtype give the reference's logits at the bound, in x's dtype."""
    qt = _table(4, 32, True, 1000, 256)
    p = PreparedTable.from_table(qt)
    x = torch.randn(m, 512).to(dt)[:, ::2]
    assert not x.is_contiguous()
    out = p.linear(x)
    assert out.dtype == dt and p.last_kernel.startswith("native")
    _check_linear(p, qt, x, _wabs(qt))


def test_route_remembered_until_the_rows_change():
    """The row a call shape took is remembered (no walk of the rows per decode step) and
    forgotten when the table's rows change (here: int8 activations switched on and off)."""
    qt = _table(4, 32, True, 1000, 256)
    p = PreparedTable.from_table(qt)
    x = torch.randn(1, 256, dtype=BF)
    exact = p.linear(x)
    first = p.last_kernel
    assert p._routes_seen
    p.use_activations("int8")
    assert not p._routes_seen
    p.linear(x)
    assert p.last_kernel.endswith("_a8")
    p.use_activations("exact")
    assert torch.equal(p.linear(x), exact) and p.last_kernel == first


def test_gather_ids_any_shape_dtype_and_stride():
    """The C gather takes ids as they come: int32 or int64, strided, 0-d, empty; the rows
    equal the reference's, in the ids' shape."""
    qt = _table(4, 32, True, 1000, 256)
    p = PreparedTable.from_table(qt)
    ref = qt.dequantize(BF)
    ids = torch.tensor([[5, 999, 0, 17], [3, 3, 998, 1]], dtype=torch.int32)[:, ::2]
    assert not ids.is_contiguous()
    for i in (ids, ids.long(), torch.tensor(7), torch.empty(0, 3, dtype=torch.long)):
        got = p.embedding(i, BF)
        assert got.shape == (*i.shape, 256) and torch.equal(got, ref[i.long()])
    assert p.layout._gather_so


def test_bias_and_empty_batch():
    qt = _table(8, 32, True, 1000, 256)
    p = PreparedTable.from_table(qt)
    x = torch.randn(2, 256, dtype=BF)
    b = torch.randn(1000, dtype=BF)
    assert torch.equal(p.linear(x, bias=b), p.linear(x) + b)
    assert p.linear(torch.empty(0, 256, dtype=BF)).shape == (0, 1000)


def test_native_kernel_unavailable_falls_back_with_one_warning(monkeypatch):
    """No compiler: no native variant, torch's layouts serve, one warning names why."""
    fastpath._warned.clear()
    for lib in dispatch.LIBS:
        monkeypatch.setattr(lib, "_lib", False)
        monkeypatch.setattr(lib, "_reason", "no C compiler found")
    qt = _table(8, None, True, 1000, 256)
    with pytest.warns(RuntimeWarning, match="no C compiler found"):
        p = PreparedTable.from_table(qt)
    assert p.kind == "int8_row"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        PreparedTable.from_table(qt)
    for x in _xs(256):
        _check_linear(p, qt, x, _wabs(qt))


@pytest.mark.parametrize("name", sorted(lib.name for lib in dispatch.LIBS))
def test_native_build_failure_is_a_reason_not_an_error(name, monkeypatch, tmp_path):
    """A compiler that fails: the variant is unavailable with the compiler's message. A CPU
    without the variant's features gives that reason instead (the compiler is not asked)."""
    lib = next(lib for lib in dispatch.LIBS if lib.name == name)
    isa = name
    if lib._refused():
        assert "CPU lacks" in lib.unavailable() or "not x86" in lib.unavailable()
        pytest.skip(f"{isa}: {lib.unavailable()} (the build is not attempted)")
    monkeypatch.setattr(lib, "_lib", None)
    monkeypatch.setenv("EMBEDQ_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "cc"))
    (tmp_path / "cc").write_text("#!/bin/sh\necho 'cc: error: broken' >&2\nexit 1\n")
    (tmp_path / "cc").chmod(0o755)
    assert "broken" in lib.unavailable()
    monkeypatch.setattr(lib, "_lib", None)  # let later tests load the real one


def test_docs_show_the_dispatch_table():
    """docs/vllm.md prints the one dispatch table as it is."""
    from pathlib import Path
    from embedq.kernels import dispatch
    doc = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    assert dispatch.table_markdown() in doc


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
