"""The fused kernels produce the eager reference's bytes exactly (compiled and eager)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from embedq.quant import fused as kernels
from embedq.format.codec import pack_int32
from embedq.quant.rtn import quantize_rtn
from embedq.format.scheme import Scheme

BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
SCHEMES = [(b, g, s) for b, g, s in itertools.product((4, 8), (None, 32, 128), (True, False))]


def table(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows spanning many magnitudes, plus the cases rounding is decided on."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 3)
    x[0] = 0  # all-zero row: scale 1
    x[1, :32] = 0  # all-zero group
    x[2] = torch.arange(cols) - cols / 2 + 0.5  # exact .5 ties after scaling
    x[3] = torch.linspace(-1, 1, cols) * 127  # exact ties at scale 1
    x[4] = -torch.rand(cols, generator=g)  # only negative values (asym range contains 0)
    x[5] = torch.rand(cols, generator=g) + 3  # only positive values
    x[6, ::7] = 1e-30  # subnormal / tiny values
    x[7, 1::16] = -x[7, ::16].abs().float() * 1.001  # signed-max: negative extremes, positive scales
    x[8, ::8] = x[8, 1::8].abs() + 0.25  # ... positive extremes, negative scales
    x[9, :2] = torch.tensor([3.0, -3.0])  # ... a tie: the positive one is the extreme
    return x.to(dtype)


def assert_same(got, ref) -> None:
    packed, scale, zp, _ = got
    rpacked, rscale, rzp, _ = ref
    assert packed.dtype == torch.int32 and packed.shape == rpacked.shape
    assert torch.equal(packed, rpacked)
    assert scale.dtype == rscale.dtype and torch.equal(scale.view(torch.uint8) if scale.element_size() == 1
                                                       else scale.contiguous().view(torch.int16 if scale.element_size() == 2 else torch.int32),
                                                       rscale.contiguous().view(torch.int16 if rscale.element_size() == 2 else torch.int32))
    assert (zp is None) == (rzp is None)
    if zp is not None:
        assert torch.equal(zp, rzp)


def reference(x, scheme, sd):
    q, s, zp = quantize_rtn(x, scheme, sd)
    return pack_int32(q, scheme.bits), s, zp, None


@pytest.mark.parametrize("bits,group,sym", SCHEMES)
@pytest.mark.parametrize("src", [BF, F16, F32])
def test_eager_kernel_function_matches_reference(bits, group, sym, src):
    """``fused_rtn`` run eagerly (the code torch.compile compiles) equals the reference."""
    x = table(256, 256, src)
    for sd in (BF, F16, F32):
        scheme = Scheme.default(bits, sym, group if group else 0)
        pairs = x.dtype == BF and bits in kernels.PAIRS_BITS
        xin = x.view(torch.int32) if pairs else x
        packed, s, zp, *_ = kernels.fused_rtn(xin, bits, scheme.effective_group(256), sym, sd, False, pairs)
        assert_same((packed.reshape(256, -1).view(torch.int32), s, zp, None), reference(x, scheme, sd))


def test_stats_match_eager_statistics():
    x = table(256, 256, BF)
    for bits, group, sym in SCHEMES:
        scheme = Scheme.default(bits, sym, group if group else 0)
        xin = x.view(torch.int32) if bits in kernels.PAIRS_BITS else x
        out = kernels.fused_rtn(xin, bits, scheme.effective_group(256), sym, BF, True,
                                bits in kernels.PAIRS_BITS)
        ref = kernels.reference(x, scheme, BF, True)[3]
        assert float(out[3]) == ref[0]
        assert float(out[4]) == pytest.approx(ref[1], rel=1e-5)
        assert float(out[5]) == pytest.approx(ref[2], rel=1e-5)


needs_compile = pytest.mark.skipif(not kernels._have_compiler() or not kernels.compile_enabled(),
                                   reason="no C++ compiler / compilation disabled")

# Each combination is one ahead-of-time compilation (~10 s, then cached on disk): a
# representative set by default, every combination with EMBEDQ_PERF_FULL=1.
COMPILED_CASES = [
    (8, None, True, BF, BF), (8, 128, True, BF, BF), (4, 32, True, BF, BF), (4, None, True, BF, BF),
    (8, 32, False, BF, BF), (4, 128, False, BF, BF),
    (8, None, True, BF, F16), (4, 32, True, BF, F32), (8, 128, False, F16, F16), (4, 32, False, F32, F32),
]
if os.environ.get("EMBEDQ_PERF_FULL"):
    COMPILED_CASES = [(b, g, s, src, sd) for (b, g, s) in SCHEMES for src in (BF, F16, F32)
                      for sd in (BF, F16, F32)]


@needs_compile
@pytest.mark.parametrize("bits,group,sym,src,sd", COMPILED_CASES)
def test_compiled_matches_eager(bits, group, sym, src, sd):
    x = table(192, 256, src, seed=bits * 7 + (group or 1))
    scheme = Scheme.default(bits, sym, group if group else 0)
    got = kernels.quantize_pack(x, scheme, sd, True, compiled=True)
    ref = kernels.quantize_pack(x, scheme, sd, True, compiled=False)
    assert_same(got, ref)
    assert got[3][0] == ref[3][0]  # max |error| is exact; the sums may differ in the last bits
    assert got[3][1] == pytest.approx(ref[3][1], rel=1e-5)
    assert got[3][2] == pytest.approx(ref[3][2], rel=1e-5)


@needs_compile
def test_compiled_padded_tail_chunk():
    """A short last chunk is zero-padded to the compiled shape: same bytes, same stats."""
    x = table(192, 256, BF, seed=3)[:100]
    scheme = Scheme.default(4, True, 32)
    got = kernels.quantize_pack(x, scheme, BF, True, compiled=True, pad_rows=192)
    ref = kernels.quantize_pack(x, scheme, BF, True, compiled=False)
    assert got[0].shape[0] == 100
    assert_same(got, ref)
    assert got[3][1] == pytest.approx(ref[3][1], rel=1e-5)


def test_compile_disabled_by_env(monkeypatch):
    monkeypatch.setenv("EMBEDQ_COMPILE", "0")
    assert kernels.kernel_backend() == "eager"
    x = table(64, 128, BF)
    scheme = Scheme.default(8)
    assert_same(kernels.quantize_pack(x, scheme, BF), reference(x, scheme, BF))


def test_compile_failure_falls_back_to_eager(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("no compiler here")
    monkeypatch.setenv("EMBEDQ_KERNEL", "aoti")  # the inductor kernel's own fallback
    monkeypatch.setattr(kernels, "_compiled", broken)
    x = table(64, 128, BF)
    scheme = Scheme.default(4)
    with pytest.warns(RuntimeWarning, match="eager"):
        got = kernels.quantize_pack(x, scheme, BF)
    assert_same(got, reference(x, scheme, BF))
    assert kernels._compiled is False
    assert kernels.kernel_backend() == "eager"


@needs_compile
@pytest.mark.parametrize("bits,group,sym", [(8, None, True), (4, 32, False)])
def test_jit_mode_matches_eager(monkeypatch, bits, group, sym):
    """The torch.compile (JIT) variant, used with EMBEDQ_KERNEL=jit, is bit-identical too."""
    monkeypatch.setenv("EMBEDQ_KERNEL", "jit")
    monkeypatch.setattr(kernels, "_compiled", None)
    x = table(128, 256, BF, seed=9)
    scheme = Scheme.default(bits, sym, group if group else 0)
    got = kernels.quantize_pack(x, scheme, BF, True, compiled=True)
    assert not isinstance(kernels._compiled, kernels.AotiKernels)
    assert_same(got, kernels.quantize_pack(x, scheme, BF, True, compiled=False))


@needs_compile
def test_aoti_outputs_are_not_reused_between_calls():
    """The pipeline keeps a chunk's outputs while the next chunk runs."""
    x = table(192, 256, BF, seed=4)
    scheme = Scheme.default(8, True, 128)
    a = kernels.quantize_pack(x, scheme, BF, True, compiled=True)
    keep = [t.clone() for t in a[:2]]
    kernels.quantize_pack(-x, scheme, BF, True, compiled=True)
    assert torch.equal(a[0], keep[0]) and torch.equal(a[1], keep[1])
