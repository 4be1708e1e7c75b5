"""The prepared native layout asks Linux for 2 MiB pages: speed only, the same bytes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from embedq.format.codec import QuantizedTable
from embedq.format.scheme import Scheme
from embedq.kernels import PreparedTable, hugepages
from embedq.quant.rtn import quantize_rtn

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(addr: int) -> list[str]:
    """VmFlags of the mapping holding addr (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            a, b = (int(v, 16) for v in head.split("-"))
            inside = a <= addr < b
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="this kernel has no transparent huge pages (or they are off)")
def test_a_large_layout_tensor_is_aligned_and_madvised():
    t = hugepages.huge_empty((max(hugepages.HUGE_MIN_BYTES, hugepages.HUGE_MIN_OUTPUT) // 2,), torch.int16)
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0 and t.is_contiguous()
    assert "hg" in _vm_flags(t.data_ptr())  # MADV_HUGEPAGE took
    t.fill_(7)
    assert int(t.sum()) == 7 * t.numel()
    small = hugepages.huge_empty((3, 5), torch.float32)  # below the threshold: torch's own
    assert small.shape == (3, 5) and small.dtype == torch.float32


@pytest.mark.parametrize("bits,group,sym", [(4, 32, True), (8, 64, False), (8, 0, True)])
def test_layout_and_logits_equal_with_and_without_huge_pages(bits, group, sym, monkeypatch):
    rows, cols = 3001, 256  # odd rows: the padded last block
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(bits)) * 0.05
    q, s, zp = quantize_rtn(w, Scheme(bits=bits, symmetric=sym, group_size=group or None), torch.bfloat16)
    qt = QuantizedTable.from_codes(q, s, zp, bits, group or cols)
    x = torch.randn(17, cols, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)  # AMX: M >= 16
    ids = torch.tensor([0, 17, rows - 1])
    monkeypatch.setattr(hugepages, "HUGE_MIN_BYTES", 1 << 62)  # torch's allocations throughout
    plain = PreparedTable.from_table(qt, dtype=torch.bfloat16)
    ref_out, ref_rows = plain.linear(x), plain.layout.rows(ids)
    monkeypatch.setattr(hugepages, "HUGE_MIN_BYTES", 1)  # every tensor (and output) on the mmap path
    monkeypatch.setattr(hugepages, "HUGE_MIN_OUTPUT", 1)
    huge = PreparedTable.from_table(qt, dtype=torch.bfloat16)
    assert plain.layout.name == huge.layout.name == "native"
    for name in ("w", "s", "z"):
        a, b = getattr(plain.layout, name), getattr(huge.layout, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert plain.nbytes == huge.nbytes
    for xd in (torch.bfloat16, torch.float32):  # the vdpbf16ps / AMX kernels and the float32 builds
        out, ref = huge.linear(x.to(xd)), ref_out if xd == torch.bfloat16 else plain.linear(x.to(xd))
        if huge.last_kernel.startswith("native_"):  # every C kernel's output comes from huge_empty
            assert out.data_ptr() % hugepages.HUGE_PAGE == 0, huge.last_kernel
        assert torch.equal(out, ref), huge.last_kernel
    for a, b in zip(ref_rows, huge.layout.rows(ids)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


def test_outputs_below_the_output_floor_keep_torch_allocation():
    """Outputs below HUGE_MIN_OUTPUT (2 MiB pages measured slower there) are plain tensors;
    tables from HUGE_MIN_BYTES on."""
    n = hugepages.HUGE_MIN_OUTPUT // 2 // 2  # half the floor, in int16
    out = hugepages.huge_empty((n,), torch.int16)
    tab = hugepages.huge_empty((n,), torch.int16, table=True)
    assert out.untyped_storage().nbytes() == n * 2  # torch.empty: no oversized view
    if sys.platform.startswith("linux") and n * 2 >= hugepages.HUGE_MIN_BYTES:
        assert tab.data_ptr() % hugepages.HUGE_PAGE == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the output pool is Linux's mmap path")
@pytest.mark.parametrize("hold", ["view", "numpy", "dlpack"])
def test_an_output_is_reused_only_after_torch_frees_its_storage(hold, monkeypatch):
    """Pooled outputs: a mapping goes back to the pool only when nothing can reach the tensor's
    memory any more (a view, a numpy array or a DLPack capsule keeps it out); the pool keeps at
    most POOL_BYTES of free mappings."""
    import gc

    import torch.utils.dlpack as dlpack

    shape = (hugepages.HUGE_MIN_OUTPUT // 2 // 4, 4)  # int16: exactly the output floor
    monkeypatch.setattr(hugepages, "_pool", {})

    def fresh():
        t = hugepages.huge_empty(shape, torch.int16)
        assert t.shape == shape and t.data_ptr() % hugepages.HUGE_PAGE == 0
        return t

    a = fresh()
    a.fill_(3)
    addr = a.data_ptr()
    holder = {"view": lambda: a[1:2], "numpy": a.numpy, "dlpack": lambda: dlpack.to_dlpack(a)}[hold]()
    del a
    gc.collect()
    b = fresh()
    assert b.data_ptr() != addr  # not handed out while something can still read it
    del b, holder
    gc.collect()
    got = [fresh(), fresh()]
    assert addr in [t.data_ptr() for t in got]  # freed: reused, its pages already faulted in
    assert int(next(t for t in got if t.data_ptr() == addr)[1, 0]) == 3  # contents not cleared
    del got
    gc.collect()
    monkeypatch.setattr(hugepages, "_pool", {})
    monkeypatch.setattr(hugepages, "POOL_BYTES", 0)
    d = fresh()
    del d
    gc.collect()
    assert not any(hugepages._pool.values())  # beyond POOL_BYTES a freed mapping is dropped
