"""Triton kernels (CUDA) over one quantized table AS STORED: logits and row gathers.

The table is the overlay's compressed-tensors ``pack-quantized`` layout, unchanged:
``packed`` int32 [V, K*bits/32] (32/bits codes per word, element 0 in the low bits,
offset binary ``u = q + 2^(bits-1)``), ``scale`` [V, G] (G = 1 per row), signed int8
``zero_point`` [V, G] or None. The head and the gather of a tied model read the same
buffer: one resident table, no repacked copy.

* :func:`logits` ``x @ ((q - zp) * s)^T``: each program loads a [BN, BK] tile of code
  words, unpacks it, subtracts the zero points in the integer domain (``|q - zp| <= 255``
  is exact in fp16 and bf16, so the dot sees the exact integers; this is the ``s*z*sum(x)``
  epilogue term without its cancellation), converts to the activation dtype and calls
  ``tl.dot`` with a float32 accumulator; the row/group scale multiplies the partial sum
  of each group (per row: once, at the end). Each code is decoded once per M tile:
  for M <= BM (all of M = 1..64 with the configs below, 1..128 at M > 64) exactly once.
* :func:`gather` rows by token id: ``(q - zp) * s`` in float32, cast to the output dtype
  (bit-exact to :func:`embedq.format.codec.dequantize_codes`).

Launch configs (fixed, no autotuning): :data:`CONFIGS` by M range; with groups, BK is the
largest power of two <= the config's BK dividing the group size (one ``tl.dot`` per group
slice; groups must be multiples of 16, :func:`unsupported`). The configs are the usual
Triton GEMM shapes, NOT tuned: no GPU was available when they were written, and no GPU
time has been measured. Activations: bf16/fp16 (float32 runs an IEEE fp32 dot: slow).

Triton is imported lazily (CPU installs do not have it). Under ``TRITON_INTERPRET=1``
(numpy-backed, CPU tensors) the same kernels run for tests, with the interpreter's known
limits worked around here: bf16 is computed as float32 (bf16 scales are upcast exactly,
bf16 outputs are cast by torch), and codes are converted to a float dtype before the dot.
Set ``TRITON_INTERPRET`` before the first call: Triton decides at decoration time.
"""

from __future__ import annotations

import os

import torch

# (largest M, BM, BN, BK, num_warps, num_stages); the last row also serves M > 256.
# M <= 16: decode; a 16-row tile (tl.dot's minimum) and narrow BN for many programs
# over the vocabulary (memory bound: V/64 programs keep every SM busy for V >= 10k).
CONFIGS = (
    (16, 16, 64, 128, 4, 4),
    (64, 64, 64, 64, 4, 3),
    (256, 128, 128, 64, 8, 3),
)
GATHER_BLOCK = 256  # columns per gather program

_KERNELS = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def forced() -> bool:
    """``EMBEDQ_SERVE_KERNEL=triton``: use the Triton route on CPU tensors too (interpreter)."""
    return os.environ.get("EMBEDQ_SERVE_KERNEL", "").strip().lower() == "triton"


def available(device) -> str | None:
    """None when the Triton kernels can run on ``device``; else a one-line reason."""
    dev = torch.device(device)
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None
    if not forced():
        return f"device {dev.type} (Triton serves CUDA; EMBEDQ_SERVE_KERNEL=triton forces it)"
    if dev.type == "cpu" and not _interpreting():
        return "EMBEDQ_SERVE_KERNEL=triton on CPU tensors needs TRITON_INTERPRET=1"
    if dev.type != "cpu":
        return f"device {dev.type}"
    return None


def unsupported(bits: int, group_size: int | None, cols: int) -> str | None:
    """None when the kernels handle this scheme/shape; else a one-line reason."""
    if bits not in (4, 8):
        return f"{bits}-bit codes"
    if (cols * bits) % 32:
        return f"{cols} columns of {bits} bits are not whole int32 words"
    if group_size is not None and (group_size % 16 or cols % group_size):
        return f"groups of {group_size} (the Triton kernel needs multiples of 16)"
    return None


def config_for(m: int) -> tuple[int, int, int, int, int, int]:
    """The launch config for ``m`` activation rows."""
    return next((c for c in CONFIGS if m <= c[0]), CONFIGS[-1])


def _group_bk(g: int, bk: int) -> int:
    """Largest power of two <= bk dividing g (g % 16 == 0: at least 16)."""
    b = bk
    while g % b:
        b //= 2
    return b


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        from embedq.kernels import triton_src  # imports triton: only when a kernel runs
        _KERNELS = (triton_src.logits_kernel, triton_src.gather_kernel)
    return _KERNELS


def _check(packed, scale, zero_point, bits, group_size, cols) -> int:
    why = unsupported(bits, group_size, cols)
    if why is not None:
        raise ValueError(f"triton_head: {why}")
    V = packed.shape[0]
    g = cols if group_size is None else group_size
    if tuple(packed.shape) != (V, cols * bits // 32) or packed.dtype != torch.int32:
        raise ValueError(f"packed {packed.dtype} {list(packed.shape)} is not int32 {[V, cols * bits // 32]}")
    if tuple(scale.shape) != (V, cols // g):
        raise ValueError(f"scale {list(scale.shape)} is not {[V, cols // g]}")
    if zero_point is not None and (zero_point.shape != scale.shape or zero_point.dtype != torch.int8):
        raise ValueError(f"zero_point {zero_point.dtype} {list(zero_point.shape)} is not int8 {list(scale.shape)}")
    return g


def _interp_scale(scale: torch.Tensor) -> torch.Tensor:
    # the interpreter reads bf16 wrongly; float32 holds every bf16 value exactly
    return scale.float() if _interpreting() and scale.dtype == torch.bfloat16 else scale


def logits(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
           zero_point: torch.Tensor | None, *, bits: int, group_size: int | None,
           cols: int) -> torch.Tensor:
    """``x @ ((q - zp) * s)^T`` for x [M, cols]: [M, V] in x's dtype (float32 accumulation)."""
    g = _check(packed, scale, zero_point, bits, group_size, cols)
    if x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"x {list(x.shape)} is not [M, {cols}]")
    out_dtype = x.dtype
    if _interpreting() and x.dtype == torch.bfloat16:
        x = x.float()
    x = x.contiguous()
    packed = packed.contiguous()
    scale = _interp_scale(scale).contiguous()
    zp = None if zero_point is None else zero_point.contiguous()
    M, V = x.shape[0], packed.shape[0]
    out = torch.empty(M, V, dtype=x.dtype, device=x.device)
    if M == 0 or V == 0:
        return out.to(out_dtype)
    kernel, _ = _kernels()
    _, BM, BN, BK, warps, stages = config_for(M)
    per_row = group_size is None
    bk = BK if per_row else _group_bk(g, BK)
    grid = (-(-V // BN), -(-M // BM))
    kernel[grid](x, packed, scale, packed if zp is None else zp, out, M, V, cols, packed.shape[1],
                 x.stride(0), packed.stride(0), scale.stride(0), out.stride(0),
                 BITS=bits, GROUP=g, PER_ROW=per_row, HAS_ZP=zp is not None,
                 IEEE=x.dtype == torch.float32, BM=BM, BN=BN, BK=bk,
                 num_warps=warps, num_stages=stages)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def gather(ids: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
           zero_point: torch.Tensor | None, *, bits: int, group_size: int | None, cols: int,
           dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (any shape) as [..., cols] ``dtype``: ``(q - zp) * s`` in float32, cast."""
    g = _check(packed, scale, zero_point, bits, group_size, cols)
    flat = ids.reshape(-1).to(device=packed.device, dtype=torch.int64).contiguous()
    kdt = torch.float32 if _interpreting() and dtype == torch.bfloat16 else dtype
    out = torch.empty(flat.numel(), cols, dtype=kdt, device=packed.device)
    if flat.numel():
        _, kernel = _kernels()
        packed = packed.contiguous()
        scale = _interp_scale(scale).contiguous()
        zp = None if zero_point is None else zero_point.contiguous()
        grid = (flat.numel(), -(-cols // GATHER_BLOCK))
        kernel[grid](flat, packed, scale, packed if zp is None else zp, out, packed.shape[0], cols,
                     packed.stride(0), scale.stride(0), out.stride(0),
                     BITS=bits, GROUP=g, HAS_ZP=zp is not None, BLOCK=GATHER_BLOCK)
    return out.to(dtype).view(*ids.shape, cols)
