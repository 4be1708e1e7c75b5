"""A small C kernel for RTN quantize + pack (+ error statistics), built in well under a second.

The heavy, element-wise part of RTN (``u = clamp(round(x / s) + zp) + 2^(b-1)``, packed,
plus the error statistics) is one loop in C, compiled on first use with the system C
compiler (``cc -O3 -march=native -ffp-contract=off``; ~0.3 s, no torch headers, no
inductor) into :func:`embedq.kernels.build.kernel_cache_dir` and loaded with
:mod:`ctypes` (which releases the GIL during the call). Scales and zero points are
computed in C too, by the reference's operations (the C source: :mod:`.native_src`, its
AVX-512 / AVX2 paths in :mod:`.native_simd`; on AVX-512 small groups run 16 at a time).

Bit-identity with :func:`embedq.quant.rtn.quantize_rtn` holds because every float
operation is the reference's own IEEE operation in the same order: float32 ``x / s``
(a correctly rounded division, never a reciprocal), ``rintf`` (round half to even, as
``torch.round``), float adds of small integers (exact), and no FMA contraction. Group
maxima are exact whatever the order. Only the float statistics' sums may differ in
their last bits (summation order), as with the inductor kernel.

Sources: bf16 and float32 tables (bf16 -> float32 is a shift). float16 tables take the
eager path. Nothing here is needed for correctness: without a C compiler, or with
``EMBEDQ_KERNEL=eager|aoti|jit``, the other kernels run and write the same bytes.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading

import torch

from embedq.kernels.build import SCALE_KIND, LazyLibrary, kernel_cache_dir
from embedq.quant.native_src import C_SOURCE
from embedq.quant.profile import stage

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-math-errno",
         "-fopenmp-simd",
         "-shared", "-fPIC"]

_lock = threading.Lock()  # the kernel thread pool's


def _signatures(lib) -> None:
    P, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quant_vector.restype = F
    lib.quant_vector.argtypes = []
    for n in ("quant_bf16", "quant_f32"):
        getattr(lib, n).argtypes = [P, I, I, F, F, F, P, P, P, P]
        getattr(lib, n).restype = None


# The one loader (kernels.build.LazyLibrary): built on first use, at most once per process.
LIBRARY = LazyLibrary("native", C_SOURCE, FLAGS, ["-lm"], setup=_signatures, label="native quantize")


def library():
    """The loaded kernel library, or None (see :func:`unavailable_reason`)."""
    return LIBRARY.get()


def unavailable_reason() -> str | None:
    return LIBRARY.unavailable()


def supports_dtype(dtype: torch.dtype) -> bool:
    """Source dtypes the C kernel reads (float16 tables take the other kernels)."""
    return dtype in (torch.bfloat16, torch.float32)


def quantize_pack(x: torch.Tensor, bits: int, group: int, symmetric: bool,
                  scale_dtype: torch.dtype, stats: bool):
    """``(packed_uint8 [rows, cols*bits/8], scale, zp_int8 | None, stats | None)`` of one chunk.

    Same bytes as ``quantize_rtn`` + ``pack_int32``; ``stats`` is ``(max_abs, sq_err,
    sq_ref)`` as floats. The caller checks :func:`library` and :func:`supports_dtype` first.
    """
    lib = library()
    rows, cols = x.shape
    x = x.contiguous()
    groups = cols // group
    s = torch.empty(rows, groups, dtype=scale_dtype)
    zp = None if symmetric else torch.empty(rows, groups, dtype=torch.int8)
    out = torch.empty(rows, cols * bits // 8, dtype=torch.uint8)
    fn = lib.quant_bf16 if x.dtype == torch.bfloat16 else lib.quant_f32
    # Rows are independent: with more than one kernel thread (torch.get_num_threads(), which
    # the pipeline sets from EMBEDQ_KERNEL_THREADS) the chunk is cut into row ranges run in
    # parallel (ctypes releases the GIL). Same bytes; only the statistics' sums reassociate.
    parts = max(1, min(torch.get_num_threads(), x.numel() * x.element_size() // _MIN_PART_BYTES, rows))
    bounds = [rows * i // parts for i in range(parts + 1)]
    sts = [(ctypes.c_double * 3)() if stats else None for _ in range(parts)]
    xs, ss, os_ = x.element_size(), s.element_size(), cols * bits // 8

    def run(i: int) -> None:
        a, b = bounds[i], bounds[i + 1]
        fn(x.data_ptr() + a * cols * xs, (b - a) * groups, group, bits, 0 if symmetric else 1,
           SCALE_KIND[scale_dtype], s.data_ptr() + a * groups * ss,
           None if zp is None else zp.data_ptr() + a * groups, out.data_ptr() + a * os_, sts[i])

    if parts == 1:
        run(0)
    else:
        _run_parallel(run, parts)
    if not stats:
        return out, s, zp, None
    m = [st[0] for st in sts]
    mx = math.nan if any(v != v for v in m) else max(m)
    return out, s, zp, (mx, math.fsum(st[1] for st in sts), math.fsum(st[2] for st in sts))


_MIN_PART_BYTES = 1 << 20  # smaller parts are not worth a thread hand-off
_pool_obj = None


def _pool(n: int):
    global _pool_obj
    with _lock:
        if _pool_obj is None or _pool_obj._max_workers < n:
            from concurrent.futures import ThreadPoolExecutor
            _pool_obj = ThreadPoolExecutor(n, thread_name_prefix="embedq-kernel")
        return _pool_obj


def _run_parallel(run, parts: int) -> list:
    """``run(0)`` here and ``run(1..parts-1)`` on the kernel pool; wait for all."""
    futures = [_pool(parts - 1).submit(_timed, run, i) for i in range(1, parts)]
    run(0)
    return [f.result() for f in futures]


def _timed(run, i: int) -> None:
    with stage("kernel: quantize + pack + stats"):
        run(i)



__all__ = ["kernel_cache_dir", "library", "supports_dtype", "quantize_pack", "unavailable_reason", "C_SOURCE"]
