"""Every fast path of embedq.kernels against the reference (dequantize, then index / F.linear):
every scheme and serving layout (native, torch's int8/int4, chunked) at every tile remainder
of M and vocab size, gathers bit-exact, logits within the bound derived in
``fastpathutil.py``; the fallbacks (unsupported schemes, no compiler, a failing build) with
their one warning; activation and id views (misaligned, strided, any dtype), remembered
routes, bias and empty batches, and the docs' copy of the dispatch table. The x86 kernels'
own paths (AMX, vdpbf16ps, vendor row order) are in ``test_fastpath_x86.py``.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from embedq.kernels import layouts
from embedq.kernels import prepared as fastpath
from embedq.kernels import PreparedTable, dispatch
from tests.perf.fastpathutil import (BF, F16, F32, NATIVE_LAYOUT, _check_linear, _native_kernel, _table, _wabs,
                                     _xs)

# (rows, cols): vocab sizes not divisible by any kernel tile; cols=96 gives odd group counts
SHAPES = [(1000, 256), (4097, 96)]
SCHEMES = [(b, g, s) for b, g, s in itertools.product((8, 4), (None, 32, 64, 128), (True, False))]
CASES = [(b, g, s, shape) for (b, g, s), shape in itertools.product(SCHEMES, SHAPES)
         if g is None or shape[1] % g == 0]


@pytest.fixture
def torch_layouts(monkeypatch):
    """Only torch's weight-only layouts (the fallbacks where the native kernel cannot run)."""
    monkeypatch.setenv("EMBEDQ_SERVE_KERNEL", "torch")


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
