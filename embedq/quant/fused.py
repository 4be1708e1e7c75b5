"""Fused per-chunk kernels: quantize + pack (+ error statistics) in one pass.

The reference path (:func:`embedq.quant.rtn.quantize_rtn`, then
:func:`embedq.format.codec.pack_int32`, then ``ErrorStats.update``) runs a dozen
eager torch ops per chunk, each reading and writing a full-size temporary. Here the
same arithmetic is written once as a function of a chunk and compiled with
``torch.compile`` (inductor's C++ backend; gcc/clang must be on the machine), so the
chunk is read from cache a couple of times instead of a dozen.

Contract: for every scheme (4/8 bits, per row or grouped, symmetric or not) and every
scale dtype, the packed bytes, scales and zero points are **bit-identical** to the
eager reference (``tests/perf`` checks it); only the error statistics, which are
reported but never written to disk, may differ in the last bits of their float64 sums.

Compilation (AOTInductor, :class:`AotiKernels`) happens once per machine, chunk shape
and scheme; the package is kept in ``~/.cache/embedq/kernels`` (``EMBEDQ_KERNEL_CACHE``)
and later processes load its shared library in milliseconds, without importing inductor.
``EMBEDQ_KERNEL=jit`` uses in-process ``torch.compile`` instead. Where compilation is
unavailable (no C++ compiler, unsupported platform, ``EMBEDQ_COMPILE=0``) the eager
reference runs: slower, same bytes.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import shutil
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from embedq.format.codec import pack_int32
from embedq.format.codec import dequantize_codes
from embedq.quant.rtn import quantize_rtn
from embedq.format.scheme import Scheme
from embedq.format import scheme_units
from embedq.format.scheme_units import unit_for
from embedq.quant import native
from embedq.kernels.build import cache_path, publish

log = logging.getLogger(__name__)

_INT16_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass(frozen=True)
class KernelSpec:
    """Everything a compiled kernel is specialised on (besides the chunk shape)."""

    bits: int
    group: int  # elements per scale (cols for per-row)
    symmetric: bool
    scale_dtype: torch.dtype
    stats: bool


def _round_scale_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Same result as :func:`embedq.quant.rtn.round_scale_up` (magnitude never rounded
    down; signed-max scales may be negative), branch-free."""
    if dtype == torch.float32:
        return scale
    s = scale.to(dtype)
    low = s.float().abs() < scale.abs()
    return torch.where(low, (s.view(_INT16_OF[dtype]) + 1).view(dtype), s)


def fused_rtn(x: torch.Tensor, bits: int, group: int, symmetric: bool,
              scale_dtype: torch.dtype, stats: bool, pairs: bool = False):
    """Quantize and pack one chunk ``x`` [rows, cols].

    Returns ``(packed, scale, zero_point, max_abs, sq_err, sq_ref)``: ``packed`` holds
    the packed bytes [rows, cols*bits/8] (as uint8, or as int32 words when ``pairs``;
    view it as int32 for ``weight_packed``), ``zero_point`` is signed int8 [rows,
    groups] or None, and the statistics are 0-d tensors (float32 max |x̂-x|, float64
    sums of squared error and of x²) or None. The arithmetic mirrors ``quantize_rtn``
    operation for operation.

    ``pairs``: ``x`` is a bf16 chunk viewed as int32 [rows, cols/2] (two adjacent
    elements per word). bf16 -> float32 is then a shift (exact, as ``.float()``), and
    even and odd elements are separate contiguous streams, so 4-bit packing (low
    nibble = even element) needs no strided access.
    """
    if pairs:
        rows, half = x.shape
        cols = half * 2
        xi = x.reshape(rows, cols // group, group // 2)
        parts = [(xi << 16).view(torch.float32), (xi & -65536).view(torch.float32)]
    else:
        rows, cols = x.shape
        parts = [x.float().reshape(rows, cols // group, group)]
    unit = unit_for(bits)
    qmax, qmin = unit.qmax, unit.qmin
    if symmetric:  # the family's rule (absmax / qmax, or signed-max at 4 bits)
        s = _round_scale_up(unit.symmetric_scale(parts), scale_dtype)
        sf = s.float().unsqueeze(-1)
        qs = [torch.round(p / sf).clamp(qmin, qmax) for p in parts]
        zp = None
        xhats = [q * sf for q in qs] if stats else None
    else:
        scale, lo = unit.asymmetric_scale(*unit.group_range(parts))
        s = _round_scale_up(scale, scale_dtype)
        sf1 = s.float()
        zpf = torch.round(qmin - lo / sf1).clamp(qmin, qmax)
        sf = sf1.unsqueeze(-1)
        zpe = zpf.unsqueeze(-1)
        qs = [(torch.round(p / sf) + zpe).clamp(qmin, qmax) for p in parts]
        zp = zpf.to(torch.int8)
        xhats = [(q - zpe) * sf for q in qs] if stats else None
    # u = q + 2^(bits-1) is an exact small integer in float32: convert via int32.
    us = [(q + unit.offset).to(torch.int32) for q in qs]
    if pairs:  # even element in the low bits: little-endian byte order
        packed = unit.pack_pairs(us[0], us[1]).reshape(rows, cols // 2)
    else:
        packed = unit.pack_bytes(us[0].reshape(rows, cols)).to(torch.uint8)
    if not stats:
        return packed, s, zp, None, None, None
    # Per-group float32 partial sums (same iteration space as the passes above, so
    # they fuse into them), then float64 across groups.
    max_abs = sq_err = sq_ref = None
    for p, xh in zip(parts, xhats):
        d = xh - p
        m = d.abs().amax()
        e = (d * d).sum(dim=-1).double().sum()
        r = (p * p).sum(dim=-1).double().sum()
        max_abs = m if max_abs is None else torch.maximum(max_abs, m)
        sq_err = e if sq_err is None else sq_err + e
        sq_ref = r if sq_ref is None else sq_ref + r
    return packed, s, zp, max_abs, sq_err, sq_ref


# --- compilation management ----------------------------------------------------------

_lock = threading.Lock()
_compiled = None  # the torch.compile'd fused_rtn, or False when compiling failed
_disabled_reason: str | None = None


def compile_enabled() -> bool:
    """Whether compiled kernels will be tried (``EMBEDQ_COMPILE=0`` turns them off)."""
    if kernel_mode() == "eager":
        return False
    return _compiled is not False


def _have_compiler() -> bool:
    cxx = os.environ.get("CXX")
    return bool((cxx and shutil.which(cxx)) or shutil.which("g++") or shutil.which("clang++")
                or shutil.which("c++"))


def _source_fingerprint() -> str:
    try:
        src = (inspect.getsource(fused_rtn) + inspect.getsource(_round_scale_up)
               + inspect.getsource(scheme_units))
    except (OSError, TypeError):  # pragma: no cover - no sources (zipapp)
        from embedq.version import __version__ as src
    return hashlib.sha256(src.encode()).hexdigest()[:16]


class AotiKernels:
    """``fused_rtn`` compiled ahead of time (AOTInductor) per shape and scheme.

    The first use of a (shape, dtype, scheme) builds a package with inductor (seconds
    to tens of seconds) into :func:`kernel_cache_dir`; every later process loads the
    shared library directly, without importing inductor or tracing anything
    (milliseconds), which is what makes compiling worth it for a CLI that runs once.
    """

    def __init__(self) -> None:
        self._runners: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def __call__(self, x, bits, group, symmetric, scale_dtype, stats, pairs):
        key = (tuple(x.shape), x.dtype, bits, group, symmetric, scale_dtype, stats, pairs)
        run = self._runners.get(key)
        if run is None:
            with self._lock:
                run = self._runners.get(key) or self._load(key)
                self._runners[key] = run
        outs = iter(run([x]))
        packed, s = next(outs), next(outs)
        zp = None if symmetric else next(outs)
        ma = se = sr = None
        if stats:
            ma, se, sr = next(outs), next(outs), next(outs)
        return packed, s, zp, ma, se, sr

    @staticmethod
    def package_path(key: tuple) -> Path:
        cap = torch.backends.cpu.get_cpu_capability()
        return cache_path("fused_rtn", (torch.__version__, cap, _source_fingerprint(), key), ".pt2")

    def _load(self, key: tuple):
        path = self.package_path(key)
        if not path.is_file():
            self._build(key, path)
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        return loader.run

    @staticmethod
    def _build(key: tuple, path: Path) -> None:
        import importlib
        inductor = importlib.import_module("torch._inductor")
        ic = importlib.import_module("torch._inductor.config")
        shape, dtype, *args = key

        class Kernel(torch.nn.Module):
            def forward(self, x):
                return tuple(t for t in fused_rtn(x, *args) if t is not None)

        log.info("embedq: compiling the %s kernel for %s chunks (once; cached in %s)",
                 args, list(shape), path.parent)
        ep = torch.export.export(Kernel(), (torch.zeros(shape, dtype=dtype),))

        def make(tmp: Path) -> None:
            # emulate_precision_casts: see _get_compiled.
            with ic.patch(emulate_precision_casts=True), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                inductor.aoti_compile_and_package(ep, package_path=str(tmp))
        publish(path, make)


def _kernel_key(rows: int, cols: int, dtype: torch.dtype, scheme: Scheme,
                scale_dtype: torch.dtype, stats: bool) -> tuple:
    """The AotiKernels key of the kernel :func:`quantize_pack` uses for such chunks."""
    pairs = dtype == torch.bfloat16 and scheme.unit.fused_pairs
    shape = (rows, cols // 2) if pairs else (rows, cols)
    return (shape, torch.int32 if pairs else dtype, scheme.bits, scheme.effective_group(cols),
            scheme.symmetric, scale_dtype, stats, pairs)


def has_cached_kernel(rows: int, cols: int, dtype: torch.dtype, scheme: Scheme,
                      scale_dtype: torch.dtype, stats: bool = True) -> bool:
    """Whether a compiled kernel for these chunks is already on disk (free to use)."""
    if scheme.method != "rtn" or kernel_mode() not in ("aoti", "native") or not hasattr(torch._C, "_aoti"):
        return False
    key = _kernel_key(rows, cols, dtype, scheme, scale_dtype, stats)
    return AotiKernels.package_path(key).is_file()


def kernel_mode() -> str:
    """``native`` (default: the small C kernel of :mod:`embedq.quant.native`, built in
    under a second; where it cannot run, as ``aoti``), ``aoti`` (inductor, ahead of time,
    cached on disk), ``jit`` (torch.compile) or ``eager``."""
    if os.environ.get("EMBEDQ_COMPILE", "1").strip().lower() in ("0", "false", "no", "off"):
        return "eager"
    mode = os.environ.get("EMBEDQ_KERNEL", "native").strip().lower()
    return mode if mode in ("native", "aoti", "jit", "eager") else "native"


def native_ready(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether :func:`quantize_pack` (``compiled=None``) runs the native C kernel for
    ``dtype`` tables (building it on first use: well under a second)."""
    return kernel_mode() == "native" and native.supports_dtype(dtype) and native.library() is not None


def _get_compiled():
    global _compiled, _disabled_reason
    if _compiled is not None:
        return _compiled
    with _lock:
        if _compiled is not None:
            return _compiled
        if not _have_compiler():
            _disabled_reason = "no C++ compiler found"
            _compiled = False
            return _compiled
        try:
            if kernel_mode() in ("aoti", "native") and hasattr(torch._C, "_aoti"):
                _compiled = AotiKernels()
                return _compiled
            import importlib
            # One graph per (shape, scheme, dtypes): allow more than the default 8.
            cfg = importlib.import_module("torch._dynamo").config
            cfg.recompile_limit = max(getattr(cfg, "recompile_limit", 8), 256)
            # emulate_precision_casts: inductor otherwise drops the float32 -> bf16/fp16
            # -> float32 round trip of the scales, and round-up-to-storage-dtype
            # (which needs the rounded value) would differ from eager.
            _compiled = torch.compile(fused_rtn, dynamic=False, fullgraph=True,
                                      options={"emulate_precision_casts": True})
        except Exception as e:  # pragma: no cover - depends on the platform
            _disabled_reason = f"torch.compile unavailable: {e}"
            _compiled = False
        return _compiled


def kernel_backend(dtype: torch.dtype = torch.bfloat16) -> str:
    """``native``, ``compiled`` or ``eager``: what :func:`quantize_pack` would use now."""
    if not compile_enabled():
        return "eager"
    if native_ready(dtype):
        return "native"
    return "compiled" if _get_compiled() else "eager"


def disabled_reason() -> str | None:
    return _disabled_reason


def _fallback(e: Exception) -> None:
    global _compiled, _disabled_reason
    _compiled = False
    _disabled_reason = f"compilation failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    warnings.warn(f"embedq: {_disabled_reason}; using the eager kernels (same output, slower)",
                  RuntimeWarning, stacklevel=3)


# bit widths whose fused kernel reads bf16 pairs (tests name them)
PAIRS_BITS = tuple(b for b, u in scheme_units.UNITS.items() if u.fused_pairs)


def _use_pairs(x: torch.Tensor, scheme: Scheme) -> bool:
    """bf16 chunks of a family that reads them as int32 pairs (``IntUnit.fused_pairs``)."""
    return x.dtype == torch.bfloat16 and scheme.unit.fused_pairs


def chunk_stats(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None,
                group_size: int | None) -> tuple[float, float, float]:
    """``(max |x̂-x|, Σ(x̂-x)², Σx²)`` of one chunk, eagerly.

    Like the fused kernel: float32 sums per row, float64 across rows (a full float64
    pass costs 3x the quantization itself and only changes the reported error in its
    last digits).
    """
    xf = x.float()
    d = dequantize_codes(q, scale, zp, group_size)
    d -= xf
    max_abs = float(d.abs().max())
    d.mul_(d)
    sq_err = float(d.sum(dim=-1).double().sum())
    return max_abs, sq_err, float(xf.square().sum(dim=-1).double().sum())


def reference(x: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype, stats: bool = True):
    """The eager reference: ``quantize_rtn`` + ``pack_int32`` (+ eager statistics)."""
    q, s, zp = quantize_rtn(x, scheme, scale_dtype)
    st = chunk_stats(x, q, s, zp, scheme.group_size) if stats else None
    return pack_int32(q, scheme.bits), s, zp, st


def quantize_pack(x: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype, stats: bool = True,
                  compiled: bool | None = None, pad_rows: int | None = None):
    """RTN-quantize and pack a chunk: ``(packed_int32, scale, zero_point_int8, stats)``.

    ``stats`` is ``(max_abs, sq_err, sq_ref)`` as Python floats, or None. ``compiled``:
    None = the compiled kernel when available, True = compiled or raise (tests), False =
    the eager reference. ``pad_rows``: a chunk with fewer rows is zero-padded to this
    many for the compiled kernel, so a table's last chunk reuses the same compiled
    graph (zero rows add nothing to the statistics and are cut from the outputs).
    """
    if scheme.method != "rtn":
        raise ValueError("fused kernels implement RTN only")
    use = compile_enabled() if compiled is None else compiled
    if compiled is None and use and native_ready(x.dtype):
        packed, s, zp, st = native.quantize_pack(x, scheme.bits, scheme.effective_group(x.shape[1]),
                                                 scheme.symmetric, scale_dtype, stats)
        return packed.view(torch.int32), s, zp, st
    fn = _get_compiled() if use else None
    if not fn:
        if compiled:
            raise RuntimeError(f"compiled kernels unavailable: {_disabled_reason}")
        return reference(x, scheme, scale_dtype, stats)
    rows, cols = x.shape
    xin = x
    if pad_rows and rows < pad_rows:
        xin = torch.zeros((pad_rows, cols), dtype=x.dtype)
        xin[:rows] = x
    pairs = _use_pairs(xin, scheme)
    if pairs:
        xin = xin.contiguous().view(torch.int32)
    args = (scheme.bits, scheme.effective_group(cols), scheme.symmetric, scale_dtype, stats, pairs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # inductor's "bf16 and fp16 are mixed"
            packed, s, zp, ma, se, sr = fn(xin, *args)
    except Exception as e:
        if compiled:
            raise
        _fallback(e)
        return reference(x, scheme, scale_dtype, stats)
    st = None if not stats else (float(ma), float(se), float(sr))
    packed = packed.reshape(packed.shape[0], -1).view(torch.int32)
    if packed.shape[0] != rows:
        packed, s = packed[:rows], s[:rows]
        zp = None if zp is None else zp[:rows]
    return packed, s, zp, st
