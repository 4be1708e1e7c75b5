"""embedq's fp32-FMA head kernels over the native blocked layout, for every CPU.

The same layout as :mod:`embedq.kernels.native_head` (one table: the gather and the
AVX512-BF16 kernel read it too); arithmetic and blocking are described in
``native_f32.c``: each weight is decoded once per call to exactly the reference decoder's
float32 value ``(q - z) * s``, activations are converted once per call to float32
(exact from bf16/f16), the dot accumulates in float32; only the summation order differs
from ``F.linear(x, dequant(W))``. Output in the activation dtype.

Builds of one source (:data:`VARIANTS`):

* ``avx512f``:  the AVX2 code with a 16-wide (zmm) micro-kernel, ``-mavx512f -mavx512bw
  -mavx512vl`` plus AVX2's flags (Skylake-SP … Ice Lake Xeons, Zen 4/5): bit-identical
  results to the AVX2 build (the same float32 operations per lane);
* ``avx2vnni``: the AVX2 build plus ``-mavxvnni`` (Alder Lake and later, Sierra Forest, Zen 5):
  the M = 1 plane sums in ``vpdpwssd``, bit-identical;
* ``avx2``:     ``-mavx2 -mfma -mf16c`` (x86-64-v3), explicit flags rather than
  ``-march=native`` so every such CPU runs the same, tested code;
* ``portable``: plain ``-O3`` C that the compiler vectorizes (SSE2 on x86-64, NEON on
  aarch64): any CPU with a C compiler.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from embedq.kernels.build import SCALE_KIND, LazyLibrary, c_source
from embedq.kernels.hugepages import huge_empty

SOURCE = Path(__file__).with_name("native_f32.c")
_COMMON = ["-O3", "-shared", "-fPIC", "-pthread", "-std=gnu11"]
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _setup(lib) -> None:
    P, I, Fi = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.head_f32.argtypes = [P, P, Fi, P, Fi, I, I, I, P, Fi, I, P, Fi, I, Fi]
    lib.head_f32.restype = Fi
    lib.head_f32_planes.argtypes = [P, I, I, Fi]
    lib.head_f32_planes.restype = Fi
    lib.head_q4a8.argtypes = [P, P, Fi, P, I, I, I, P, Fi, I, P, Fi, I, Fi]
    lib.head_q4a8.restype = Fi
    lib.gather_rows.argtypes = [P, P, Fi, P, Fi, Fi, I, I, I, P, I, P, Fi, Fi]
    lib.gather_rows.restype = Fi


def _source() -> str:
    return c_source(SOURCE)


AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]
VARIANTS: dict[str, LazyLibrary] = {
    "avx512f": LazyLibrary("head_avx512f", _source, [*_COMMON, "-mavx512f", "-mavx512bw", "-mavx512vl", *AVX2_FLAGS],
                           needs=("avx512f", "avx2", "fma", "f16c"), machines=("x86_64", "amd64"),
                           setup=_setup, label="native head (AVX-512F)", openmp=True),
    # the AVX2 code with AVX-VNNI (Alder Lake and later cores, Sierra Forest, Zen 5): only the
    # M = 1 planes change (vpdpwssd for vpmaddwd + vpaddd; integer sums, bit-identical)
    "avx2vnni": LazyLibrary("head_avx2vnni", _source, [*_COMMON, *AVX2_FLAGS, "-mavxvnni"],
                            needs=("avx2", "fma", "f16c", "avx_vnni"), machines=("x86_64", "amd64"), setup=_setup,
                            label="native head (AVX2 + AVX-VNNI)", openmp=True),
    "avx2": LazyLibrary("head_avx2", _source, [*_COMMON, "-mavx2", "-mfma", "-mf16c"],
                        needs=("avx2", "fma", "f16c"), machines=("x86_64", "amd64"), setup=_setup,
                        label="native head (AVX2+FMA)", openmp=True),
    "portable": LazyLibrary("head_portable", _source, _COMMON, setup=_setup, label="native head (portable C)",
                            openmp=True),
}



# The same source with AVX512-VNNI: the int8-activation rows (eq_q4a8.h, vpdpbusd) and 4-bit
# at M = 1 (eq_q4planes.h, vpdpwssd) on AVX-512 CPUs that have it (Cascade Lake and later, Zen 4/5).
A8_VARIANTS: dict[str, LazyLibrary] = {
    "avx512vnni": LazyLibrary("head_avx512vnni", _source,
                              [*_COMMON, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", *AVX2_FLAGS],
                              needs=("avx512f", "avx512bw", "avx512_vnni", "avx2", "fma", "f16c"),
                              machines=("x86_64", "amd64"), setup=_setup, label="native head (AVX-512 VNNI)",
                              openmp=True),
}


# The AVX2 builds over the 4-bit dword layout (-DEQ_Q4D; layouts.NativeQ4D): 8 columns of a
# row per uint32, so the M = 1 planes decode 64 codes in 4 operations (eq_q4planes.h).
Q4D_VARIANTS: dict[str, LazyLibrary] = {
    "avx2vnni": LazyLibrary("head_avx2vnni_q4d", _source, [*_COMMON, *AVX2_FLAGS, "-mavxvnni", "-DEQ_Q4D"],
                            needs=("avx2", "fma", "f16c", "avx_vnni"), machines=("x86_64", "amd64"), setup=_setup,
                            label="native head (AVX2 + AVX-VNNI, 4-bit dwords)", openmp=True),
    "avx2": LazyLibrary("head_avx2_q4d", _source, [*_COMMON, *AVX2_FLAGS, "-DEQ_Q4D"],
                        needs=("avx2", "fma", "f16c"), machines=("x86_64", "amd64"), setup=_setup,
                        label="native head (AVX2+FMA, 4-bit dwords)", openmp=True),
}


def _call(lib: LazyLibrary, x: torch.Tensor, rows: int):
    """What both head entries take per call: the loaded build, x contiguous in its own dtype and
    that dtype's code (the C entry converts it, exactly, where a torch cast cost ~60 us a decode
    step with the caches cold), and the output [M, rows] in x's dtype."""
    so = lib.loaded()
    if so is None:
        raise RuntimeError(lib.unavailable())
    if not x.is_contiguous():
        x = x.contiguous()
    # from 32 MiB, the output pool's pages (hugepages.py): AMD EPYC Zen 4, synthetic Gemma head,
    # interleaved, M = 256 Q4 g32 / int8 g64 0.87-0.93x (AVX2 build) and 0.86-0.94x (AVX-512F)
    return so, x, _OUT_KIND[x.dtype], huge_empty((x.shape[0], rows), x.dtype)


def head(lib: LazyLibrary, w, s, z, bits: int, rows: int, cols: int, group: int,
         x: torch.Tensor) -> torch.Tensor:
    """``x [M, cols] @ dequant(W)^T`` -> [M, rows] in x's dtype (bf16, f16 or f32), by the
    build ``lib`` (one of :data:`VARIANTS`)."""
    so, x, xk, out = _call(lib, x, rows)
    rc = so.head_f32(w.data_ptr(), s.data_ptr(), SCALE_KIND[s.dtype], None if z is None else z.data_ptr(),
                     bits, rows, cols, group, x.data_ptr(), xk, x.shape[0], out.data_ptr(), xk, rows,
                     torch.get_num_threads())
    if rc:
        raise RuntimeError(f"{lib.label} failed ({rc}: out of memory or bad shape)")
    return out


def gather_library() -> ctypes.CDLL | None:
    """The build whose ``gather_rows`` (plain C in every build) serves gathers: the first that
    runs here — the one the head has loaded, not a build of its own; None where none runs."""
    return next((lib for v in VARIANTS.values() if (lib := v.get()) is not None), None)


def gather(so: ctypes.CDLL, w, s, z, bits: int, span: int, rows: int, cols: int, group: int, ids: torch.Tensor,
           dtype: torch.dtype) -> torch.Tensor | None:
    """Rows ``ids`` (any shape) as [..., cols] ``dtype`` by ``so``'s ``gather_rows``, the
    reference's bits; None where ``dtype`` is not bf16/f16/f32 (the caller then takes the
    reference gather)."""
    if dtype not in _OUT_KIND:
        return None
    # only the torch ops a call needs: each costs ~20-40 us with the caches cold (a decode step's
    # embedding after the head streamed through them)
    flat = ids if ids.dim() == 1 else ids.reshape(-1)
    if flat.dtype != torch.int64:
        flat = flat.to(torch.int64)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    out = torch.empty((*ids.shape, cols), dtype=dtype)
    n = flat.shape[0]
    rc = so.gather_rows(w.data_ptr(), s.data_ptr(), SCALE_KIND[s.dtype], None if z is None else z.data_ptr(), bits,
                        span, rows, cols, group, flat.data_ptr(), n, out.data_ptr(), _OUT_KIND[dtype],
                        torch.get_num_threads())
    if rc == 3:
        raise IndexError(f"token id out of range for a table of {rows} rows")
    if rc:
        raise RuntimeError(f"native gather failed ({rc}: out of memory)")
    return out


def head_a8(lib: LazyLibrary, w, s, z, rows: int, cols: int, group: int, x: torch.Tensor) -> torch.Tensor | None:
    """Like :func:`head` for a 4-bit table, with ``x`` quantized to int8 per row and block of
    32 columns (:mod:`embedq.kernels.actquant`; ``EMBEDQ_ACTIVATIONS=int8``). None when ``x``
    holds inf or NaN (the caller runs the exact kernel)."""
    so, x, xk, out = _call(lib, x, rows)
    rc = so.head_q4a8(w.data_ptr(), s.data_ptr(), SCALE_KIND[s.dtype], None if z is None else z.data_ptr(),
                      rows, cols, group, x.data_ptr(), xk, x.shape[0], out.data_ptr(), xk, rows,
                      torch.get_num_threads())
    if rc == 3:
        return None
    if rc:
        raise RuntimeError(f"{lib.label} failed ({rc}: out of memory or bad shape)")
    return out


__all__ = ["A8_VARIANTS", "Q4D_VARIANTS", "SOURCE", "VARIANTS", "gather", "gather_library", "head", "head_a8"]
