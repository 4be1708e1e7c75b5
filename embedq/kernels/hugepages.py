"""2 MiB pages for what the CPU kernels stream: the prepared tables and large outputs.

Why: a head call reads the whole table (90-160 MiB for Gemma 3 270M) and, at M >= 16,
writes an output of the same order (M x 262,144 logits). With 4 KiB pages every 4 KiB of
that is a TLB miss, and every 4 KiB of a fresh output a page fault. Linux's default mode
for transparent huge pages ("madvise") backs only regions that ask; asking before the first
touch gets 2 MiB pages where memory allows. Measured on a Xeon with AMX (Gemma-shaped head,
interleaved with bf16 F.linear, docs/performance.md): the table at M = 1, AVX2 build, Q4 g32
5.5 -> 5.1-5.3 ms, int8 g64 7.7 -> 6.3 ms; the output at M = 256, AMX, Q4 g32 107 -> 81 ms.
Contents never change; where Linux has no THP the allocation is plain.
"""

from __future__ import annotations

import ctypes
import mmap
import warnings

import torch

HUGE_PAGE = 2 << 20
HUGE_MIN_BYTES = 4 * HUGE_PAGE  # smaller tensors keep torch's allocation


def huge_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype)`` in fresh anonymous memory, 2 MiB-aligned and madvised
    ``MADV_HUGEPAGE`` (Linux, at least :data:`HUGE_MIN_BYTES`; otherwise, or where madvise
    fails, a plain allocation: huge pages change speed only, never contents)."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if n < HUGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    # mmap, not torch.empty: malloc may hand back heap pages already touched, which stay
    # 4 KiB; private, because a shared anonymous map is shmem (THP off there by default)
    m = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    off = -ctypes.addressof(ctypes.c_char.from_buffer(m)) % HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, off, n // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without THP: 4 KiB pages, same bytes
        pass
    with warnings.catch_warnings():  # frombuffer keeps m alive as long as the tensor
        warnings.simplefilter("ignore")
        buf = torch.frombuffer(m, dtype=torch.uint8)
    return buf[off:off + n].view(dtype).view(shape)


__all__ = ["HUGE_MIN_BYTES", "HUGE_PAGE", "huge_empty"]
