"""The native C kernel writes the eager reference's bytes exactly, for every scheme."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from embedq.format.scheme import Scheme
from embedq.quant import fused as kernels, native
from tests.perf.test_kernels import BF, F16, F32, SCHEMES, assert_same, table

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason=f"no native kernel: {native.unavailable_reason()}")


# every scheme on every shape whose columns its group divides (no skipped combinations)
CASES = [(*sc, shape) for sc in SCHEMES for shape in [(256, 256), (64, 640), (128, 136)]
         if not sc[1] or shape[1] % sc[1] == 0]


@pytest.mark.parametrize("bits,group,sym,shape", CASES)
@pytest.mark.parametrize("src", [BF, F32])
def test_native_matches_reference(bits, group, sym, src, shape):
    rows, cols = shape
    x = table(rows, cols, src, seed=cols)
    for sd in (BF, F16, F32):
        scheme = Scheme.default(bits, sym, group if group else 0)
        packed, s, zp, st = native.quantize_pack(x, bits, scheme.effective_group(cols), sym, sd, True)
        ref = kernels.reference(x, scheme, sd, True)
        assert_same((packed.view(torch.int32), s, zp, None), ref)
        assert st[0] == ref[3][0]  # same float ops: the same max |x̂ - x|
        assert st[1] == pytest.approx(ref[3][1], rel=1e-5)
        assert st[2] == pytest.approx(ref[3][2], rel=1e-5)


def _cpu_has(flag: str) -> bool:
    from pathlib import Path
    info = Path("/proc/cpuinfo")
    return info.exists() and f" {flag} " in info.read_text().replace("\n", " ")


@pytest.mark.parametrize("build", ["native", "avx2"])
def test_vector_groups_equal_the_scalar_loops(build, monkeypatch):
    """Groups of a multiple of the vector width take the AVX-512 (16) or AVX2 (8) path where
    the compiler targets it (-march=native; ``avx2``: the same with -mno-avx512f, what an
    AVX2-only CPU builds): each writes the scalar loops' bytes, scales and zero points exactly,
    and the same max |x̂ - x|, every scheme, with zeros, signed zeros, subnormals, infinities
    and NaN in the table (the sums only reassociate). -DEQ_QUANT_SCALAR builds the loops alone.
    Small groups run 16 at a time on AVX-512 (one reduction tree, the scales in a vector): 97
    rows leave groups after the last batch of 16 for the one-group path."""
    from embedq.kernels.build import LazyLibrary

    def lib_of(name, extra):
        return LazyLibrary(name, native.C_SOURCE, [*native.FLAGS, *extra], ["-lm"], setup=native._signatures,
                           label=f"native quantize ({name})").get()
    if build == "native":
        lib, width = native.library(), 16 if _cpu_has("avx512f") else 8 if _cpu_has("avx2") else 0
    else:
        if not _cpu_has("avx2"):
            pytest.skip("this CPU has no AVX2 (the scalar loops are the ones tested above)")
        lib, width = lib_of("native_avx2", ["-mno-avx512f"]), 8
    if not _cpu_has("avx2") and not _cpu_has("avx512f"):
        pytest.skip("no x86 vector path on this CPU (the scalar loops are the ones tested above)")
    assert lib is not None and lib.quant_vector() == width  # the path under test is the one built
    scalar = lib_of("native_scalar", ["-DEQ_QUANT_SCALAR"])
    assert scalar is not None and scalar.quant_vector() == 0
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-45, 3e38])
    for src in (BF, F32):
        x = table(97, 640, src, seed=7)  # 97 rows: groups left over after the batches of 16 too
        x[3] = 0
        x[4, :] = -x[4, :].abs()  # all negative: asym zero point at qmax, signed-max picks the minimum
        x[5, 100:108] = specials.to(src)
        x[6, 33] = float("nan")
        x[7, 0] = float("inf")
        for (bits, group, sym), sd in itertools.product(SCHEMES, (BF, F16, F32)):
            g = Scheme.default(bits, sym, group if group else 0).effective_group(640)
            res = []
            for one in (lib, scalar):
                with monkeypatch.context() as m:
                    m.setattr(native.LIBRARY, "get", lambda one=one: one)
                    res.append(native.quantize_pack(x, bits, g, sym, sd, True))
            got, want = res
            for a, b in zip(got[:3], want[:3]):
                assert (a is None and b is None) or torch.equal(a.view(torch.uint8), b.view(torch.uint8)), \
                    (src, bits, g, sym, sd)
            assert math.isnan(got[3][0]) == math.isnan(want[3][0])
            assert math.isnan(got[3][0]) or got[3][0] == want[3][0]
            for i in (1, 2):  # the sums reassociate only
                assert got[3][i] == pytest.approx(want[3][i], rel=1e-5, nan_ok=True), (src, bits, g, sym, sd, i)


def test_quantize_pack_uses_native_by_default(monkeypatch):
    monkeypatch.delenv("EMBEDQ_KERNEL", raising=False)
    monkeypatch.delenv("EMBEDQ_COMPILE", raising=False)
    assert kernels.kernel_backend(BF) == "native"
    assert kernels.kernel_backend(F16) != "native"
    x = table(192, 512, BF)
    for bits, group, sym in SCHEMES:
        scheme = Scheme.default(bits, sym, group if group else 0)
        assert_same(kernels.quantize_pack(x, scheme, BF), kernels.reference(x, scheme, BF))
    monkeypatch.setenv("EMBEDQ_COMPILE", "0")
    assert kernels.kernel_backend(BF) == "eager"


def test_non_finite_values_reach_the_statistics():
    x = table(64, 256, BF)
    x[5, 7] = float("nan")
    *_, st = native.quantize_pack(x, 8, 256, True, BF, True)
    assert any(math.isnan(v) for v in st)
    x = table(64, 256, F32)
    x[9, 3] = float("inf")
    packed, s, _, st = native.quantize_pack(x, 4, 32, False, F32, True)
    assert not all(math.isfinite(v) for v in st)


def test_native_unavailable_falls_back(monkeypatch):
    monkeypatch.delenv("EMBEDQ_KERNEL", raising=False)
    monkeypatch.setattr(native.LIBRARY, "_lib", False)  # as when no C compiler is found
    assert not kernels.native_ready(BF)
    x = table(64, 128, BF)
    scheme = Scheme.default(8)
    assert_same(kernels.quantize_pack(x, scheme, BF, compiled=False),
                kernels.reference(x, scheme, BF))
    assert kernels.kernel_backend(BF) != "native"
