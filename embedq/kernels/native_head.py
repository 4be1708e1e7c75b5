"""embedq's own CPU head kernel: ``x @ dequant(W)^T`` exact on bf16 activations, at every M.

Why: torch's weight-only CPU kernels decode the weights again for every 4 activation rows
(their cost grows with the batch); W8A8 kernels quantize the head's input, which costs more
accuracy on Gemma than the table's own quantization. This kernel does neither:

* int8 and 4-bit codes are exact in bf16, so each code is converted to bf16 once per call
  (16 rows x 2 columns per 512-bit register) and multiplied with the bf16 activations by
  AVX512-BF16 ``vdpbf16ps`` (exact products, float32 sums); the row/group scale is applied
  once per group after the dot, and asymmetric rows subtract ``z * sum(x_group)`` first.
  The result is the reference ``x @ ((q - z) * s)^T`` up to float32 summation order.
* every weight byte is read from memory once per call whatever M is: a block of 16 rows
  stays in L1 while every tile of activations (16 rows; with groups at M ≤ 8, one tile of 8) runs over
  it: one tile decodes the column pairs in registers; with more than one tile the block is
  decoded once into an L1 scratch that every tile reloads (M = 256: 1.36x -> 1.05x bf16
  F.linear on an AMD EPYC with AVX512-BF16; docs/performance.md).
* activations are transposed once per call into bf16 pairs (exact), so each broadcast is
  one memory operand.

Layout (the ONE prepared table: the gather reads it too): rows in blocks of 16 (the last
padded with zero scales), columns in pairs: ``[NB, K/2, 16, pair]`` holding each pair as
its unit's ``to_native`` bytes (format/scheme_units.py; int8: two signed codes, 4-bit: the
stored byte of two offset nibbles, low = column 2p);
scales ``[NB, G, 16]`` in their stored dtype; zero points ``[NB, G, 16]`` int8. Same bytes
as the overlay plus the row padding.

Needs x86-64 with AVX512F/BW/VL and AVX512_BF16 and a C compiler (built once, ~1 s,
cached by source and CPU flags); otherwise :func:`unavailable` says why and the dispatch
table serves the same layout with :mod:`embedq.kernels.native_f32` (AVX2 or portable C).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from embedq.format.scheme_units import unit_for
from embedq.kernels.build import SCALE_KIND, LazyLibrary, c_source, cpu_flags
from embedq.kernels.hugepages import huge_empty

# The C source beside this module (a real .c file: compilers, linters and diffs read it).
SOURCE = Path(__file__).with_name("native_bf16.c")


def source_for(l2_prefetch: bool) -> str:
    """The vdpbf16ps kernel's C source, its code stream prefetched into L2 (``EQ_BF16_PF_L2``:
    native_bf16.c says what it measured) or into L1."""
    return ("#define EQ_BF16_PF_L2 1\n" if l2_prefetch else "") + c_source(SOURCE)


def _source() -> str:
    """This CPU's form: L2 on AMD; Intel keeps the L1 form measured there. The vendor is a
    feature (``EMBEDQ_CPU_FEATURES=-vendor_amd`` drops it)."""
    return source_for("vendor_amd" in cpu_flags())

FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off",
         "-shared", "-fPIC", "-pthread"]
NEEDS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "f16c")
BLOCK = 16  # rows per block (one 512-bit register of float32 lanes)


def _setup(lib) -> None:
    P, I, Fi = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.head_bf16.argtypes = [P, P, Fi, P, Fi, I, I, I, P, I, P, I, Fi]
    lib.head_bf16.restype = Fi


LIB = LazyLibrary("head", _source, FLAGS, needs=NEEDS, machines=("x86_64", "amd64"), setup=_setup,
                  label="native head (AVX512-BF16)", openmp=True)


# The AMX-BF16 build (native_amx.c): the same layout in tile dot products (Sapphire Rapids
# and later). Its setup asks Linux for tile-data permission; refused -> unavailable, with why.
AMX_SOURCE = Path(__file__).with_name("native_amx.c")
AMX_NEEDS = (*NEEDS, "amx_tile", "amx_bf16")


def _setup_amx(lib) -> None:
    P, I, Fi = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.head_amx.argtypes = [P, P, Fi, P, Fi, I, I, I, P, Fi, I, P, I, Fi]
    lib.head_amx.restype = Fi
    lib.amx_init.restype = Fi
    if lib.amx_init() != 0:
        raise RuntimeError("Linux refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM)")


AMX_LIB = LazyLibrary("head_amx", lambda: c_source(AMX_SOURCE), [*FLAGS, "-mamx-tile", "-mamx-bf16"],
                      needs=AMX_NEEDS, machines=("x86_64", "amd64"), setup=_setup_amx,
                      label="native head (AMX-BF16)", openmp=True)


def unavailable() -> str | None:
    """None when the AVX512-BF16 kernel can run here, else why not (one line)."""
    return LIB.unavailable()


def supports(bits: int, cols: int, group: int, scale_dtype: torch.dtype) -> str | None:
    """None when the layout takes this scheme, else why not."""
    if bits not in (4, 8):
        return f"{bits}-bit codes"
    if cols % 2 or group % 2:
        return f"odd columns/groups ({cols}/{group}): the kernel reads column pairs"
    if scale_dtype not in SCALE_KIND:
        return f"{scale_dtype} scales"
    return None


def amx_fits(cols: int, group: int) -> str | None:
    """Why the AMX kernel cannot serve a table (None: it can): a tile is 32 columns."""
    return None if cols % 32 == 0 and group % 32 == 0 else f"columns/group ({cols}/{group}) not multiples of 32"


def _blocked(t: torch.Tensor, rows_padded: int) -> torch.Tensor:
    """[rows, n, ...] -> [rows_padded / 16, n, 16, ...] (padding rows zero)."""
    pad = rows_padded - t.shape[0]
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    t = t.view(rows_padded // BLOCK, BLOCK, *t.shape[1:]).transpose(1, 2)
    out = huge_empty(t.shape, t.dtype, table=True)
    out.copy_(t)
    return out


def pack(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
         bits: int, cols: int, step_rows: int, span: int = 2):
    """The blocked layout ``(w, s, z)`` from overlay tensors, ``step_rows`` rows at a time.
    ``span``: columns per unit of a row kept together (2: column pairs; 8: the 4-bit dword
    layout of :class:`embedq.kernels.layouts.NativeQ4D`, four native bytes per unit)."""
    unit = unit_for(bits)
    rows, ub = packed.shape[0], unit.native_pair_bytes * span // 2
    nb = -(-rows // BLOCK)
    w = huge_empty((nb, cols // span, BLOCK, ub), getattr(torch, unit.native_dtype), table=True)
    step = max(BLOCK, step_rows // BLOCK * BLOCK)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        byt = packed[a:b].contiguous().view(torch.uint8).reshape(b - a, -1)
        blk = unit.to_native(byt).view(b - a, cols // span, ub)
        pb = -(-(b - a) // BLOCK) * BLOCK
        w[a // BLOCK: a // BLOCK + pb // BLOCK] = _blocked(blk, pb)
    s = _blocked(scale, nb * BLOCK)
    z = None if zero_point is None else _blocked(zero_point.to(torch.int8), nb * BLOCK)
    return w, s, z


def codes(w: torch.Tensor, bits: int, ids: torch.Tensor, cols: int) -> torch.Tensor:
    """Signed codes int8 [n, cols] of rows ``ids`` read from the blocked layout."""
    blk, lane = ids // BLOCK, ids % BLOCK
    return unit_for(bits).from_native(w[blk, :, lane].reshape(ids.numel(), -1)).reshape(-1, cols)


def block_codes(w: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Signed codes int8 [16 * blocks, cols] of whole blocks ``w`` [blocks, cols/span, 16, unit]."""
    rows = w.shape[0] * BLOCK
    return unit_for(bits).from_native(w.transpose(1, 2).reshape(rows, -1)).reshape(rows, cols)


def group_params(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-group scales or zero points [n, G] of rows ``ids`` from ``[NB, G, 16]``."""
    return t[ids // BLOCK, :, ids % BLOCK]


def head(w, s, z, bits: int, rows: int, cols: int, group: int, x: torch.Tensor) -> torch.Tensor:
    """``x [M, cols] bf16 @ dequant(W)^T`` -> [M, rows] bf16."""
    lib = LIB.loaded()
    if not x.is_contiguous():
        x = x.contiguous()
    M = x.shape[0]
    # 2 MiB pages from the output pool (hugepages.py): AMD EPYC Zen 4, synthetic Gemma head
    # int8 g64 M = 256: 271.8 ms in fresh 4 KiB pages, 223.6 in reused or 2 MiB ones
    out = huge_empty((M, rows), torch.bfloat16)
    lib.head_bf16(w.data_ptr(), s.data_ptr(), SCALE_KIND[s.dtype], None if z is None else z.data_ptr(),
                  bits, rows, cols, group, x.data_ptr(), M, out.data_ptr(), rows,
                  torch.get_num_threads())
    return out


def head_amx(w, s, z, bits: int, rows: int, cols: int, group: int, x: torch.Tensor) -> torch.Tensor:
    """:func:`head` in AMX tiles for bf16, float16 or float32 ``x`` (output in its dtype;
    ``cols`` and ``group`` multiples of 32)."""
    lib = AMX_LIB.loaded()
    if not x.is_contiguous():
        x = x.contiguous()
    M = x.shape[0]
    out = huge_empty((M, rows), x.dtype)  # faults: M = 256 Q4 g32 96.5 -> 79.0 ms (hugepages.py)
    rc = lib.head_amx(w.data_ptr(), s.data_ptr(), SCALE_KIND[s.dtype], None if z is None else z.data_ptr(),
                      bits, rows, cols, group, x.data_ptr(), SCALE_KIND[x.dtype], M, out.data_ptr(), rows,
                      torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"AMX head kernel: no memory for its {M}-row activation tiles")
    return out


__all__ = ["AMX_LIB", "amx_fits", "head_amx", "BLOCK", "SOURCE", "codes", "source_for", "group_params", "head", "pack", "supports", "unavailable"]
