"""2 MiB pages for what the CPU kernels stream: the prepared tables and the head kernels' outputs.

Why: at M >= 16 a head call writes an output of the table's order (M x 262,144 logits for
Gemma 3 270M: 134 MB at M = 256), so with 4 KiB pages it pays a page fault per 4 KiB and a
TLB miss per row block it stores; freshly allocated per call, it also pays the faults and the
zeroing of every page each time (the output pool below). Linux's default mode for
transparent huge pages ("madvise") backs only regions that ask; asking before the first
touch gets 2 MiB pages where memory allows. Measured on a Xeon with AMX (Gemma-shaped head,
interleaved, docs/performance.md): M = 256 Q4 g32 96.5 -> 79.0 ms, int8 g64 93.9 -> 76.8;
M = 64 Q4 g32 29.2 -> 26.7 (outputs below 32 MiB stay torch's: HUGE_MIN_OUTPUT). The vdpbf16ps
kernel's take them (on a Zen 4, where it serves large M: int8 g64 M = 256 271.8 -> 223.6 ms), and
so do the AVX2 and AVX-512F kernels' since the pool below: fresh 2 MiB pages had measured 1-2 %
slower for them on that Xeon (two threads faulting the same pages), pooled ones, faulted once,
0.86-0.94x at M = 256 on a Zen 4 (twenty-second session; docs/performance.md). The
tables (read whole at every call) take them too; at M = 1 that measured within the run-to-run
noise. Contents never change; where Linux has no THP the
allocation is plain.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
import warnings
import weakref

import torch

HUGE_PAGE = 2 << 20
HUGE_MIN_BYTES = 4 * HUGE_PAGE  # smaller tensors keep torch's allocation
# Outputs from 32 MiB only: smaller ones (Gemma head M = 16 / 32, 8 / 16 MiB, table from
# memory) measured 2-20 % slower in 2 MiB pages, with outliers to 1.7x (two threads
# faulting the same few pages; rows 2*V bytes apart in one L2 set), M = 64 (32 MiB) int8
# 23.1 -> 21.0 ms, Q4 g32 within the noise, M = 256 the gains above.
HUGE_MIN_OUTPUT = 16 * HUGE_PAGE
_MADV_HUGEPAGE = 14  # Linux


def _mapping(n: int) -> tuple[mmap.mmap, int]:
    """An anonymous private mapping of ``n`` bytes from a 2 MiB boundary (its offset),
    madvised ``MADV_HUGEPAGE`` (a private map: a shared anonymous one is shmem, where THP is
    off by default; a Python or kernel without it: 4 KiB pages)."""
    m = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    off = -ctypes.addressof(ctypes.c_char.from_buffer(m)) % HUGE_PAGE
    try:
        m.madvise(getattr(mmap, "MADV_HUGEPAGE", _MADV_HUGEPAGE), off, n // HUGE_PAGE * HUGE_PAGE)
    except (OSError, AttributeError):
        pass
    return m, off


# Outputs come from a pool of mappings whose pages are already faulted in. A fresh output
# costs its page faults and the kernel's zeroing of every page on each call (Gemma head,
# bf16, M = 64: 32 MiB, 3.7 ms of a ~20 ms call; interleaved, Xeon with AMX: the head call
# with its output reused 0.78-0.84x the time at M = 64 / 256). A mapping goes back to the
# pool only when torch frees the output's storage (its last view, numpy array or DLPack
# capsule gone: torch.frombuffer holds the exporter until then), so no tensor a caller can
# still reach is ever handed out again. At most POOL_BYTES of free mappings are kept.
POOL_BYTES = 512 << 20
_pool: dict[int, list[mmap.mmap]] = {}
_pool_lock = threading.RLock()  # re-entrant: a release can run inside a pool operation (GC)


def _release(n: int, m: mmap.mmap) -> None:
    with _pool_lock:
        free = sum((k + HUGE_PAGE) * len(v) for k, v in _pool.items())
        if free + n + HUGE_PAGE <= POOL_BYTES:
            _pool.setdefault(n, []).append(m)


def _pooled(n: int) -> torch.Tensor:
    """``n`` bytes of a pooled (or new) mapping, from a 2 MiB boundary, as a uint8 tensor."""
    with _pool_lock:
        free = _pool.get(n)
        m = free.pop() if free else None
    if m is None:
        m, off = _mapping(n)
    else:
        off = -ctypes.addressof(ctypes.c_char.from_buffer(m)) % HUGE_PAGE
    part = (ctypes.c_char * n).from_buffer(m, off)
    weakref.finalize(part, _release, n, m)
    with warnings.catch_warnings():  # frombuffer keeps part (and m) alive as long as the storage
        warnings.simplefilter("ignore")
        return torch.frombuffer(part, dtype=torch.uint8)


def huge_empty(shape, dtype: torch.dtype, *, table: bool = False) -> torch.Tensor:
    """``torch.empty(shape, dtype)``, 2 MiB-aligned and madvised ``MADV_HUGEPAGE`` before the
    first touch (Linux; a table of at least :data:`HUGE_MIN_BYTES`, an output of at least
    ``max(HUGE_MIN_BYTES, HUGE_MIN_OUTPUT)``). ``table=True`` (a prepared table: allocated
    once, never resized) takes an anonymous mapping of its own; an output (the default) one
    from the pool above (its contents are whatever the last output there held: the kernels
    write every element). Such tensors are not resizable. Where madvise fails the pages stay
    4 KiB: huge pages change speed only, never contents."""
    n = torch.Size(shape).numel() * dtype.itemsize
    if n < HUGE_MIN_BYTES or (not table and n < HUGE_MIN_OUTPUT) or not sys.platform.startswith("linux"):
        return torch.empty(shape, dtype=dtype)
    if not table:
        return _pooled(n).view(dtype).view(shape)
    m, off = _mapping(n)
    with warnings.catch_warnings():  # frombuffer keeps m alive as long as the tensor
        warnings.simplefilter("ignore")
        buf = torch.frombuffer(m, dtype=torch.uint8)
    return buf[off:off + n].view(dtype).view(shape)


__all__ = ["HUGE_MIN_BYTES", "HUGE_MIN_OUTPUT", "HUGE_PAGE", "POOL_BYTES", "huge_empty"]
