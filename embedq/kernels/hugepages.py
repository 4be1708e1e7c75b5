"""2 MiB pages for what the CPU kernels stream: the prepared tables and the AMX kernel's outputs.

Why: at M >= 16 a head call writes an output of the table's order (M x 262,144 logits for
Gemma 3 270M: 134 MB at M = 256), freshly allocated per call, so with 4 KiB pages it pays a
page fault per 4 KiB and a TLB miss per row block it stores. Linux's default mode for
transparent huge pages ("madvise") backs only regions that ask; asking before the first
touch gets 2 MiB pages where memory allows. Measured on a Xeon with AMX (Gemma-shaped head,
interleaved, docs/performance.md): M = 256 Q4 g32 96.5 -> 79.0 ms, int8 g64 93.9 -> 76.8;
M = 64 Q4 g32 29.2 -> 26.7 (outputs below 32 MiB stay torch's: HUGE_MIN_OUTPUT). The other
kernels (AVX2, AVX-512F, vdpbf16ps: compute-bound at those M) measured 1-2 % slower with them (two threads faulting the same 2 MiB pages), so their
outputs stay torch's. The tables (read whole at every call) take them too; at M = 1 that
measured within the run-to-run noise. Contents never change; where Linux has no THP the
allocation is plain.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import warnings

import torch

HUGE_PAGE = 2 << 20
HUGE_MIN_BYTES = 4 * HUGE_PAGE  # smaller tensors keep torch's allocation
# Outputs from 32 MiB only: smaller ones (Gemma head M = 16 / 32, 8 / 16 MiB, table from
# memory) measured 2-20 % slower in 2 MiB pages, with outliers to 1.7x (two threads
# faulting the same few pages; rows 2*V bytes apart in one L2 set), M = 64 (32 MiB) int8
# 23.1 -> 21.0 ms, Q4 g32 within the noise, M = 256 the gains above.
HUGE_MIN_OUTPUT = 16 * HUGE_PAGE
_MADV_HUGEPAGE = 14  # Linux
# glibc serves an allocation above its mmap threshold (32 MiB at most) from fresh pages
# unless its heap has that much free; madvise no longer turns pages already touched into
# huge ones. So an output asks for at least this much (the part past the tensor is never
# touched: address space, not memory), and a table takes a mapping of its own.
_FRESH_BYTES = 32 << 20
_madvise = None


def huge_empty(shape, dtype: torch.dtype, *, table: bool = False) -> torch.Tensor:
    """``torch.empty(shape, dtype)``, 2 MiB-aligned and madvised ``MADV_HUGEPAGE`` before the
    first touch (Linux; a table of at least :data:`HUGE_MIN_BYTES`, an output of at least
    ``max(HUGE_MIN_BYTES, HUGE_MIN_OUTPUT)``). An output (the default) is an
    ordinary torch tensor, a view into a larger, mostly untouched storage; ``table=True``
    (a prepared table: allocated once, never resized) takes an anonymous mapping of its own,
    so its pages are always fresh. Where madvise fails, or an allocator hands back pages
    already touched, the pages stay 4 KiB: huge pages change speed only, never contents."""
    global _madvise
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if n < HUGE_MIN_BYTES or (not table and n < HUGE_MIN_OUTPUT) or not sys.platform.startswith("linux"):
        return torch.empty(shape, dtype=dtype)
    if table:  # private: a shared anonymous map is shmem, where THP is off by default
        m = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        off = -ctypes.addressof(ctypes.c_char.from_buffer(m)) % HUGE_PAGE
        try:  # (a Python built without MADV_HUGEPAGE, a kernel without THP: 4 KiB pages)
            m.madvise(getattr(mmap, "MADV_HUGEPAGE", _MADV_HUGEPAGE), off, n // HUGE_PAGE * HUGE_PAGE)
        except (OSError, AttributeError):
            pass
        with warnings.catch_warnings():  # frombuffer keeps m alive as long as the tensor
            warnings.simplefilter("ignore")
            buf = torch.frombuffer(m, dtype=torch.uint8)
    else:
        if _madvise is None:
            _madvise = ctypes.CDLL(None, use_errno=True).madvise
            _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        buf = torch.empty(max(n, _FRESH_BYTES) + HUGE_PAGE, dtype=torch.uint8)
        off = -buf.data_ptr() % HUGE_PAGE
        _madvise(buf.data_ptr() + off, n // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)  # -1: no THP
    return buf[off:off + n].view(dtype).view(shape)


__all__ = ["HUGE_MIN_BYTES", "HUGE_MIN_OUTPUT", "HUGE_PAGE", "huge_empty"]
