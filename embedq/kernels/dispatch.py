"""The one dispatch table: scheme x device x batch range -> kernel.

Two decisions, both read from :data:`ROUTES`, top row first:

* at load (:func:`choose_layout`): the first row whose device and bits match and whose
  check passes picks the prepared LAYOUT (one per table: the gather reads it too);
* per call (:func:`kernel_for`): among the rows of that layout, the first whose activation
  dtype and batch range (M = rows of x) match picks the KERNEL; none matching means the
  chunked reference arithmetic over the same layout (decode a bounded chunk, F.linear).

Every row is tested against the reference decoder (``tests/perf/test_fastpath.py``,
``tests/perf/test_native_head.py``). ``EMBEDQ_SERVE_KERNEL=<layout>`` moves that layout
to the top (tests, benchmarks; e.g. ``chunked``, ``torch``, ``native``, ``triton``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@dataclass(frozen=True)
class Route:
    layout: str          # what PreparedTable holds
    device: str          # "cpu", "cuda" or "*"
    bits: tuple[int, ...]
    groups: str          # "row" (one scale per row), "group" or "any"
    acts: tuple[torch.dtype, ...]  # activation dtypes the kernel takes
    m_max: int | None    # largest M (rows of x) it serves; None: any
    kernel: str          # PreparedTable method that runs it
    why: str             # one line for docs and `describe()`


ROUTES: tuple[Route, ...] = (
    Route("triton", "cuda", (4, 8), "any", (BF16, F16, F32), None, "_linear_triton",
          "Triton over the stored pack-quantized layout (codes unpacked per tile, tl.dot, scales after)"),
    Route("native", "cpu", (4, 8), "any", (BF16,), None, "_linear_native",
          "embedq's C kernel: codes -> bf16 once per call, vdpbf16ps, scales after the dot (exact)"),
    Route("int8_row", "*", (8,), "row", (BF16,), None, "_linear_int8_row",
          "torch _weight_int8pack_mm (no compiler / no AVX512-BF16); re-decodes per 4 rows"),
    Route("int8_group", "cpu", (8,), "group", (BF16,), None, "_linear_int8_group",
          "torch _weight_int8pack_mm per group (fallback; slow)"),
    Route("int4_cpu", "cpu", (4,), "any", (BF16,), None, "_linear_int4_cpu",
          "torch _weight_int4pack_mm_for_cpu (fallback); re-decodes per 4 rows"),
    Route("chunked", "*", (4, 8), "any", (BF16, F16, F32), None, "_linear_chunked",
          "reference: dequantize a bounded chunk of rows, F.linear"),
)

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


def kernel_for(layout: str, x: torch.Tensor) -> str:
    """The PreparedTable method computing logits for ``x`` from ``layout``."""
    m, dev = x.shape[0], x.device.type
    for r in ROUTES:
        if r.layout != layout or x.dtype not in r.acts or (r.m_max is not None and m > r.m_max):
            continue
        if r.device in ("*", dev) or forced() == layout:  # a table moved elsewhere: chunked
            return r.kernel
    return "_linear_chunked"


def table_markdown() -> str:
    """The table as docs/vllm.md and docs/performance.md print it."""
    rows = ["| layout | device | bits | scales | activations | M | kernel |", "|---|---|---|---|---|---|---|"]
    for r in ROUTES:
        acts = "/".join(str(a).replace("torch.", "") for a in r.acts)
        rows.append(f"| {r.layout} | {r.device} | {'/'.join(map(str, r.bits))} | {r.groups} | {acts} | "
                    f"{'1..' + str(r.m_max) if r.m_max else 'any'} | {r.why} |")
    return "\n".join(rows)


__all__ = ["LAYOUTS", "ROUTES", "Route", "choose_layout", "forced", "kernel_for", "table_markdown"]
