"""The one dispatch table: scheme x device x batch range -> kernel.

Two decisions, both read from :data:`ROUTES`, top row first:

* at load (:func:`choose_layout`): the first row whose device and bits match and whose
  check passes picks the prepared LAYOUT (one per table: the gather reads it too);
* at load (:func:`rows_for`): the rows of that layout whose ISA variant runs on this CPU
  (``build.cpu_flags()``, so ``EMBEDQ_CPU_FEATURES`` can take features away);
* per call (:func:`kernel_for`): among those rows, the first whose activation dtype and
  batch range (M = rows of x) match picks the KERNEL; none matching means the chunked
  reference arithmetic over the same layout (decode a bounded chunk, F.linear).

Every row is tested against the reference decoder (``tests/perf/test_fastpath.py``,
``tests/perf/test_cpu_variants.py``). ``EMBEDQ_SERVE_KERNEL=<layout>`` moves that layout
to the top (tests, benchmarks; e.g. ``chunked``, ``torch``, ``native``, ``triton``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from embedq.kernels import native_f32, native_head

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@dataclass(frozen=True)
class Route:
    layout: str          # what PreparedTable holds
    device: str          # "cpu", "cuda" or "*"
    bits: tuple[int, ...]
    groups: str          # "row" (one scale per row), "group" or "any"
    acts: tuple[torch.dtype, ...]  # activation dtypes the kernel takes
    m_max: int | None    # largest M (rows of x) it serves; None: any
    kernel: str          # key of the function that runs it (prepared.KERNELS)
    why: str             # one line for docs and `describe()`
    isa: str = ""        # the C library variant it needs (ISA_LIBS), "" none


ROUTES: tuple[Route, ...] = (
    Route("triton", "cuda", (4, 8), "any", (BF16, F16, F32), None, "triton",
          "Triton over the stored pack-quantized layout (codes unpacked per tile, tl.dot, scales after)"),
    Route("native", "cpu", (4, 8), "any", (BF16,), None, "native_bf16",
          "embedq's C kernel: codes -> bf16 once per call, vdpbf16ps, scales after the dot (exact)",
          "avx512_bf16"),
    Route("native", "cpu", (4, 8), "any", (BF16, F16, F32), None, "native_avx2",
          "embedq's C kernel (x86-64-v3): weights -> reference float32 once per call, FMA", "avx2"),
    Route("native", "cpu", (4, 8), "any", (BF16, F16, F32), None, "native_portable",
          "embedq's C kernel, portable C (any CPU with a compiler; NEON on aarch64)", "portable"),
    Route("int8_row", "*", (8,), "row", (BF16,), None, "int8_row",
          "torch _weight_int8pack_mm (no compiler); re-decodes per 4 rows"),
    Route("int8_group", "cpu", (8,), "group", (BF16,), None, "int8_group",
          "torch _weight_int8pack_mm per group (fallback; slow)"),
    Route("int4_cpu", "cpu", (4,), "any", (BF16,), None, "int4_cpu",
          "torch _weight_int4pack_mm_for_cpu (fallback); re-decodes per 4 rows"),
    Route("chunked", "*", (4, 8), "any", (BF16, F16, F32), None, "chunked",
          "reference: dequantize a bounded chunk of rows, F.linear"),
)

# The C library each ISA variant needs (a variant runs where its library loads).
ISA_LIBS = {"avx512_bf16": native_head.LIB, **native_f32.VARIANTS}


def isa_unavailable(isa: str) -> str | None:
    """None when the variant runs on this CPU (as ``EMBEDQ_CPU_FEATURES`` leaves it)."""
    return None if not isa else ISA_LIBS[isa].unavailable()

LAYOUTS = tuple(dict.fromkeys(r.layout for r in ROUTES))


def _order() -> list[str]:
    """Layouts to try, in order: all of them, or those ``EMBEDQ_SERVE_KERNEL`` names
    (``torch`` = torch's weight-only ops) and then the chunked reference."""
    want = forced()
    if want is None:
        return list(LAYOUTS)
    named = {"torch": ["int8_row", "int8_group", "int4_cpu"]}.get(want, [want] if want in LAYOUTS else [])
    if not named:
        raise ValueError(f"EMBEDQ_SERVE_KERNEL={want}: not one of {', '.join(LAYOUTS + ('torch',))}")
    return named + ["chunked"]


def forced() -> str | None:
    """The layout ``EMBEDQ_SERVE_KERNEL`` asks for, or None."""
    return os.environ.get("EMBEDQ_SERVE_KERNEL", "").strip().lower() or None


def choose_layout(table, check) -> tuple[str, list[str]]:
    """``(layout, reasons the better ones were refused)``; ``check(layout)`` -> None | why not."""
    why = []
    for layout in _order():
        grouping = "row" if table.group_size is None else "group"
        rows = [r for r in ROUTES if r.layout == layout and table.bits in r.bits
                and r.groups in ("any", grouping)]
        if not rows:
            continue
        dev = {r.device for r in rows}
        if "*" not in dev and table.device.type not in dev and forced() != layout:
            continue
        reason = check(layout)
        if reason is None:
            return layout, why
        why.append(f"{layout}: {reason}")
    return "chunked", why


def rows_for(layout: str) -> tuple[Route, ...]:
    """The rows of ``layout`` whose ISA variant runs here (decided once, at load)."""
    return tuple(r for r in ROUTES if r.layout == layout and isa_unavailable(r.isa) is None)


def layout_unavailable(layout: str) -> str | None:
    """None when some row of ``layout`` can run on this CPU, else every variant's reason."""
    if rows_for(layout):
        return None
    return "; ".join(isa_unavailable(r.isa) for r in ROUTES if r.layout == layout)


def kernel_for(rows: tuple[Route, ...], x: torch.Tensor) -> Route | None:
    """The row (of a table's ``rows_for``) computing logits for ``x``; None: chunked."""
    m, dev = x.shape[0], x.device.type
    for r in rows:
        if x.dtype not in r.acts or (r.m_max is not None and m > r.m_max):
            continue
        if r.device in ("*", dev) or forced() == r.layout:  # a table moved elsewhere: chunked
            return r
    return None


def table_markdown() -> str:
    """The table as docs/vllm.md and docs/performance.md print it."""
    rows = ["| layout | device | CPU variant | bits | scales | activations | M | kernel |",
            "|---|---|---|---|---|---|---|---|"]
    for r in ROUTES:
        acts = "/".join(str(a).replace("torch.", "") for a in r.acts)
        rows.append(f"| {r.layout} | {r.device} | {r.isa or '-'} | {'/'.join(map(str, r.bits))} | {r.groups} | {acts} | "
                    f"{'1..' + str(r.m_max) if r.m_max else 'any'} | {r.why} |")
    return "\n".join(rows)


__all__ = ["ISA_LIBS", "LAYOUTS", "ROUTES", "Route", "choose_layout", "forced", "isa_unavailable",
           "kernel_for", "layout_unavailable", "rows_for", "table_markdown"]
