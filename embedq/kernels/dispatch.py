"""The one dispatch table: scheme x device x batch range -> kernel.

Two decisions, both read from :data:`ROUTES`, top row first:

* at load (:func:`choose_layout`): the first row whose device and bits match and whose
  check passes picks the prepared LAYOUT (one per table: the gather reads it too);
* at load (:func:`rows_for`): the rows of that layout whose ISA variant runs on this CPU
  (``build.cpu_flags()``, so ``EMBEDQ_CPU_FEATURES`` can take features away) and that fit
  the table; rows with int8 activations only under ``EMBEDQ_ACTIVATIONS=int8``
  (:mod:`embedq.kernels.actquant`: an opt-in, not exact);
* per call (:func:`kernel_for`): among those rows, the first whose activation dtype and
  batch range (M = rows of x) match picks the KERNEL; none matching means the chunked
  reference arithmetic over the same layout (decode a bounded chunk, F.linear).

Rows hold the layout class (:mod:`embedq.kernels.layouts`) and the kernel function, not
names: adding a CPU family is one row here and its C build (a ``LazyLibrary``).

Every row is tested against the reference decoder (``tests/perf/test_fastpath.py``,
``tests/perf/test_cpu_variants.py``). ``EMBEDQ_SERVE_KERNEL=<layout>`` moves that layout
to the top (tests, benchmarks; e.g. ``chunked``, ``torch``, ``native``, ``triton``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from embedq.kernels import actquant, native_f32, native_head
from embedq.kernels.build import LazyLibrary, cpu_flags
from embedq.kernels.layouts import Chunked, Layout, Native, NativeQ4D, Spec, Triton, chunked
from embedq.kernels.torch_layouts import Int4Cpu, Int8Group, Int8Row

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@dataclass(frozen=True)
class Route:
    """One row: which tables (layout, device, bits, grouping) and calls (activation dtype,
    M) it serves, and the function that runs it. Rows hold the layout class and the
    kernel function; ``kernel`` and ``isa`` are labels (docs, logs, tests)."""

    layout: type[Layout]  # the in-memory layout (embedq.kernels.layouts)
    device: str           # "cpu", "cuda" or "*"
    bits: tuple[int, ...]
    groups: str           # "row" (one scale per row), "group" or "any"
    acts: tuple[torch.dtype, ...]  # activation dtypes the kernel takes
    m_max: int | None     # largest M (rows of x) it serves; None: any
    kernel: str           # its name (``PreparedTable.last_kernel``)
    run: Callable[[Layout, torch.Tensor], torch.Tensor]  # (layout, x [M, cols]) -> logits
    why: str              # one line for docs and `describe()`
    lib: LazyLibrary | None = None  # the C library it needs (runs where that loads)
    isa: str = ""         # that library's CPU variant, as docs and EMBEDQ_CPU_FEATURES say it
    act: str = "exact"    # "int8": activations quantized (actquant), only under EMBEDQ_ACTIVATIONS=int8
    fits: Callable[[Spec], str | None] | None = None  # why it cannot serve a table (None: it can)
    m_min: int = 1        # smallest M it serves
    cpu: str = ""         # a CPU property it needs beyond its library's ISA (build.VENDOR_FLAGS)


_F32 = native_f32.VARIANTS
_A8 = "4-bit codes x int8 activations (blocks of 32), {}; opt-in EMBEDQ_ACTIVATIONS=int8, not exact"
# the int8-activation builds, first match first: (ISA, its library, the instruction the rows name)
_VNNI512 = native_f32.A8_VARIANTS["avx512vnni"]
_A8_BUILDS = (("avx512vnni", _VNNI512,
               "vpdpbusd (AVX512-VNNI), 16 rows x 4 columns per instruction"),
              ("avx2vnni", _F32["avx2vnni"], "vpdpbusd (AVX-VNNI), 8 rows x 4 columns per instruction"),
              ("avx512f", _F32["avx512f"], "vpmaddubsw"), ("avx2", _F32["avx2"], "vpmaddubsw"),
              ("portable", _F32["portable"], "portable C"))
_AVX512F_HEAD = Native.head_f32(_F32["avx512f"])
_AMX = dict(layout=Native, device="cpu", acts=(BF16, F16, F32), m_max=None, kernel="native_amx", run=Native.head_amx,
            lib=native_head.AMX_LIB, isa="amx_bf16", fits=Native.fits_amx)
_BF16 = dict(layout=Native, device="cpu", acts=(BF16,), m_max=None, kernel="native_bf16", run=Native.head_bf16,
             lib=native_head.LIB, isa="avx512_bf16")


def _small_m(bits: tuple[int, ...], m_max: int, acts=(BF16,)) -> "Route":
    return Route(Native, "cpu", bits, "any", acts, m_max, "native_avx512f", _AVX512F_HEAD,
                 f"the AVX-512F kernel for {'/'.join(str(a)[6:] for a in acts)} activations at small M "
                 "(memory-bound: the table read at speed)", _F32["avx512f"], "avx512f")


_Q4D = native_f32.Q4D_VARIANTS


def _with_amx(spec: Spec) -> str | None:
    """Why a row kept for AMX CPUs cannot serve here (None: the AMX kernel runs)."""
    return native_head.AMX_LIB.unavailable() or Native.fits_amx(spec)


ROUTES: tuple[Route, ...] = (
    # On an AMX CPU the exact kernels beat the int8-activation rows at every M, so under
    # EMBEDQ_ACTIVATIONS=int8 they keep serving, exactly (Emerald Rapids, Gemma head Q4 g32,
    # interleaved, ms exact vs int8 activations: M = 1 3.5 vs 5.1 (the VNNI planes), 2 4.5 vs
    # 5.4, 4 4.7 vs 6.3, 8 5.5 vs 8.3, 12 7.4 vs 11.2 (the tiles since the L1 ring, sixteenth
    # session); M = 16 9.6 vs 14.8, 64 21.8 vs 55.1 before it). float16/float32 at M = 2-15
    # (three bf16 parts a tile pass each for float32) were not measured: the int8 rows serve them.
    Route(Native, "cpu", (4,), "group", (BF16, F16, F32), 1, "native_avx512vnni", Native.head_f32(_VNNI512),
          "on AMX CPUs, the VNNI-planes row below, before the int8-activation rows (faster there, and exact)",
          _VNNI512, "avx512vnni", fits=_with_amx),
    Route(bits=(4,), groups="group", m_min=16, why="the AMX kernel below, before the int8-activation rows "
          "(faster there, and exact)", **_AMX),
    Route(**{**_AMX, "acts": (BF16,)}, bits=(4,), groups="group", m_min=2,
          why="the AMX kernel below for bfloat16 at M = 2-15, before the int8-activation rows (faster there, and exact)"),
    # Zen 4 has no row here: since the 16-row pass of the AVX512-VNNI body (twenty-third
    # session) the int8-activation rows are faster than vdpbf16ps at every M there too (AMD
    # EPYC family 25 model 17, Gemma head Q4 g32, real hidden states, interleaved, int8
    # activations / exact: M = 16 / 32 / 64 / 128 / 256 0.77 / 0.76 / 0.82 / 0.81 / 0.81).
    *(Route(Native, "cpu", (4,), "group", (BF16, F16, F32), None, f"native_{isa}_a8", Native.head_a8(lib),
            _A8.format(how), lib, isa, "int8", Native.fits_a8)
      for isa, lib, how in _A8_BUILDS),
    Route(Triton, "cuda", (4, 8), "any", (BF16, F16, F32), None, "triton", Triton.logits,
          "Triton over the stored pack-quantized layout (codes unpacked per tile, tl.dot, scales after)"),
    # bf16 activations at M <= 2 (int8) / M = 1 (4-bit): the AVX-512F kernel (codes -> float32
    # in registers, FMA) reads the table at memory speed where vdpbf16ps' decode costs more
    # (AMD EPYC, AVX512-BF16, Gemma head: int8 M = 1 5.0-5.9 vs 6.8-10.0 ms, M = 2 5.4 vs 7.1;
    # 4-bit M = 1 3.3-6.1 vs 5.0-6.6, M = 2 slower: docs/performance.md). Both rows come before
    # the AMX tile kernel too: since the code prefetch (seventh session) the AVX-512F kernel
    # is faster there at M <= 2 (Xeon with AMX, synthetic Gemma head: int8 M = 1 / 2 6.7 / 7.5
    # vs 10.6 / 10.8 ms; 4-bit M = 1 4.7 vs 7.5; M = 4 the tiles: 11.0 vs 18.5).
    # 4-bit at M = 1 with AVX512-VNNI: the planes' vpmaddwd + vpaddd as one vpdpwssd (integer
    # sums: bit-identical to the row below; Xeon with AMX, synthetic Gemma head Q4 g32, warm,
    # 2 threads: 2.73 vs 3.03 ms)
    # int8 at M = 1 takes the same planes (eq_i8planes.h, twentieth session): Xeon with AMX,
    # synthetic Gemma head, table in L3: 0.72 of the float decode, 0.89 of vpmaddwd + vpaddd;
    # from memory all equal (the stream is the bound there)
    Route(Native, "cpu", (4, 8), "any", (BF16, F16, F32), 1, "native_avx512vnni", Native.head_f32(_VNNI512),
          "the AVX-512F kernel built with AVX512-VNNI for M = 1 (its integer planes in vpdpwssd)",
          _VNNI512, "avx512vnni"),
    _small_m((4,), 1),
    _small_m((8,), 2),
    # float16 / float32 activations at M <= 2: the AMX kernel splits them into 2 / 3 bf16
    # parts, each a full tile pass; the AVX-512F kernel reads them as they are (Xeon with
    # AMX, Gemma head, table from memory: float32 int8 g64 M = 1 / 2 5.9 / 7.2 vs 12.8 / 13.0
    # ms, Q4 g32 6.4 / 7.2 vs 10.2 / 10.5; float16 int8 g64 6.0 / 7.5 vs 12.0 / 12.3, Q4 g32
    # 4.6 / 7.3 vs 9.5 / 9.4; M = 4 the tiles: 13.2 vs 16.6 (f32 int8 g64), 9.9 vs 14.1)
    _small_m((4, 8), 2, (F16, F32)),
    Route(bits=(4, 8), groups="any", why="embedq's C kernel: codes -> bf16 B tiles once per call, TDPBF16PS (AMX), "
          "scales after each group; float16/float32 activations as 2/3 exact bf16 parts (exact)", **_AMX),
    # Without AMX, on Intel: bf16 activations from M = 16 run faster on the AVX-512F kernel's
    # 6 x 64 float32 tiles than on vdpbf16ps, which costs four FMAs' time there
    # (scripts/vec_rates.c; Emerald Rapids with AMX taken away, Q4 g32 M = 8 / 16 / 32
    # 31.7 / 59.4 / 80.3 ms vs 38.0 / 47.5 / 61.9; int8 g64 M = 64 91.9 vs 112.0 on a
    # Sapphire Rapids). On Zen 4 one vdpbf16ps costs one FMA's time for twice the
    # multiply-adds, and vdpbf16ps wins at every M from 3 (AMD EPYC family 25 model 17,
    # synthetic Gemma head, twenty-first session: M = 16 / 64 / 256 int8 g64 21.9 / 68.8 /
    # 283.6 ms vs 39.4 / 131.6 / 498.1): the row is Intel's only (Cooper Lake not measured).
    Route(Native, "cpu", (4, 8), "any", (BF16,), None, "native_avx512f", _AVX512F_HEAD,
          "on Intel, the AVX-512F kernel for bf16 activations from M = 16 (vdpbf16ps costs four FMAs' time there)",
          _F32["avx512f"], "avx512f", m_min=16, cpu="vendor_intel"),
    Route(bits=(4, 8), groups="any", why="embedq's C kernel: codes -> bf16 once per call, vdpbf16ps, "
          "scales after the dot (exact)", **_BF16),
    Route(Native, "cpu", (4, 8), "any", (BF16, F16, F32), None, "native_avx512f", _AVX512F_HEAD,
          "embedq's C kernel (AVX-512F): the AVX2 kernel 16 wide (zmm FMA), bit-identical to it",
          _F32["avx512f"], "avx512f"),
    Route(Native, "cpu", (4, 8), "any", (BF16, F16, F32), None, "native_avx2vnni", Native.head_f32(_F32["avx2vnni"]),
          "the AVX2 kernel built with AVX-VNNI (M = 1: its integer planes in vpdpwssd), bit-identical to it",
          _F32["avx2vnni"], "avx2vnni"),
    Route(Native, "cpu", (4, 8), "any", (BF16, F16, F32), None, "native_avx2", Native.head_f32(_F32["avx2"]),
          "embedq's C kernel (x86-64-v3): weights -> reference float32 once per call, FMA", _F32["avx2"], "avx2"),
    Route(Native, "cpu", (4, 8), "any", (BF16, F16, F32), None, "native_portable", Native.head_f32(_F32["portable"]),
          "embedq's C kernel, portable C (any CPU with a compiler; NEON on aarch64)", _F32["portable"], "portable"),
    # Opt-in (EMBEDQ_SERVE_KERNEL=native_q4d; after the pair layout's rows, so never chosen
    # unasked): 4-bit tables as the stored words, 8 columns of a row per dword. M = 1 decodes
    # 64 codes in 4 operations and no permute; every M bit-identical to the pair layout's rows.
    # Emerald Rapids, AVX2 builds, synthetic Q4 g32 262,144 x 640: M = 1 0.82-0.86, M = 8
    # 1.04-1.05, M = 64 1.02 of native_avx2; the Gemma head on real hidden states equal within
    # noise. The default waits for a real AVX2-only CPU, where M = 1 was instruction-bound
    # (Zen 1, prototype: 0.67-0.70).
    *(Route(NativeQ4D, "cpu", (4,), "any", (BF16, F16, F32), None, f"native_{isa}_q4d", Native.head_f32(lib),
            f"the {label} kernel over the 4-bit dword layout (8 columns of a row per uint32), bit-identical to it",
            lib, isa) for isa, label in (("avx2vnni", "AVX2 + AVX-VNNI"), ("avx2", "AVX2")) for lib in (_Q4D[isa],)),
    Route(Int8Row, "*", (8,), "row", (BF16,), None, "int8_row", Int8Row.mm,
          "torch _weight_int8pack_mm (no compiler); re-decodes per 4 rows"),
    Route(Int8Group, "cpu", (8,), "group", (BF16,), None, "int8_group", Int8Group.mm,
          "torch _weight_int8pack_mm per group (fallback; slow)"),
    Route(Int4Cpu, "cpu", (4,), "any", (BF16,), None, "int4_cpu", Int4Cpu.mm,
          "torch _weight_int4pack_mm_for_cpu (fallback); re-decodes per 4 rows"),
    Route(Chunked, "*", (4, 8), "any", (BF16, F16, F32), None, "chunked", chunked,
          "reference: dequantize a bounded chunk of rows, F.linear"),
)

# The C library of each ISA variant (derived from the rows: one spelling).
ISA_LIBS = {r.isa: r.lib for r in reversed(ROUTES) if r.lib is not None}  # the first row's build per ISA
LIBS: tuple[LazyLibrary, ...] = tuple(dict.fromkeys(r.lib for r in ROUTES if r.lib is not None))  # every build
LAYOUTS: tuple[type[Layout], ...] = tuple(dict.fromkeys(r.layout for r in ROUTES))
_BY_NAME = {c.name: c for c in LAYOUTS}


def layout_named(name: str | type[Layout]) -> type[Layout]:
    """The layout class called ``name`` (as ``EMBEDQ_SERVE_KERNEL`` and tests say it)."""
    return name if isinstance(name, type) else _BY_NAME[name]


def _unavailable(r: Route) -> str | None:
    if r.cpu and r.cpu not in cpu_flags():
        return f"CPU is not {r.cpu}"
    return None if r.lib is None else r.lib.unavailable()


def isa_unavailable(isa: str) -> str | None:
    """None when the variant runs on this CPU (as ``EMBEDQ_CPU_FEATURES`` leaves it)."""
    return ISA_LIBS[isa].unavailable() if isa else None


def _order() -> list[type[Layout]]:
    """Layouts to try, in order: all of them, or those ``EMBEDQ_SERVE_KERNEL`` names
    (``torch`` = torch's weight-only ops) and then the chunked reference."""
    want = forced()
    if want is None:
        return list(LAYOUTS)
    named = [c for c in LAYOUTS if c.torch_op] if want == "torch" else [_BY_NAME[want]] if want in _BY_NAME else []
    if not named:
        raise ValueError(f"EMBEDQ_SERVE_KERNEL={want}: not one of {', '.join([*_BY_NAME, 'torch'])}")
    return [*named, Chunked]


def forced() -> str | None:
    """The layout ``EMBEDQ_SERVE_KERNEL`` asks for, or None."""
    return os.environ.get("EMBEDQ_SERVE_KERNEL", "").strip().lower() or None


def choose_layout(spec: Spec) -> tuple[type[Layout], list[str]]:
    """``(layout, reasons the better ones were refused)`` for a table of ``spec``: the
    first layout with a row for its device and bits that can run here and hold it."""
    why = []
    grouping = "row" if spec.group_size is None else "group"
    for layout in _order():
        rows = [r for r in ROUTES if r.layout is layout and spec.bits in r.bits and r.groups in ("any", grouping)]
        if not rows:
            continue
        dev = {r.device for r in rows}
        if "*" not in dev and spec.device.type not in dev and forced() != layout.name:
            continue
        reason = layout_unavailable(layout) or layout.check(spec)
        if reason is None:
            return layout, why
        why.append(f"{layout.name}: {reason}")
    return Chunked, why


def rows_for(layout: str | type[Layout], spec: Spec | None = None, act: str | None = None) -> tuple[Route, ...]:
    """The rows of ``layout`` whose C library (if any) runs here and that fit ``spec``
    (decided once, at load); int8-activation rows only for ``act="int8"`` (default:
    ``EMBEDQ_ACTIVATIONS``)."""
    layout, act = layout_named(layout), actquant.mode(act)
    return tuple(r for r in ROUTES if r.layout is layout and _unavailable(r) is None
                 and (r.act == "exact" or r.act == act) and (spec is None or _fits(r, spec)))


def _fits(r: Route, spec: Spec) -> bool:
    grouping = "row" if spec.group_size is None else "group"
    return (spec.bits in r.bits and r.groups in ("any", grouping)
            and (r.fits is None or r.fits(spec) is None))


def layout_unavailable(layout: str | type[Layout]) -> str | None:
    """None when some row of ``layout`` can run on this CPU, else every variant's reason."""
    if rows_for(layout):
        return None
    layout = layout_named(layout)
    return "; ".join(_unavailable(r) for r in ROUTES if r.layout is layout)


def kernel_for(rows: tuple[Route, ...], x: torch.Tensor) -> Route | None:
    """The row (of a table's ``rows_for``) computing logits for ``x``; None: chunked."""
    m, dev = x.shape[0], x.device.type
    for r in rows:
        if x.dtype not in r.acts or (r.m_max is not None and m > r.m_max) or m < r.m_min:
            continue
        if r.device in ("*", dev) or forced() == r.layout.name:  # a table moved elsewhere: chunked
            return r
    return None


def _m_range(r: Route) -> str:
    if r.m_max:
        return f"{r.m_min}..{r.m_max}"
    return f">= {r.m_min}" if r.m_min > 1 else "any"


def table_markdown() -> str:
    """The table as docs/vllm.md prints it."""
    rows = ["| layout | device | CPU variant | bits | scales | activations | M | kernel |",
            "|---|---|---|---|---|---|---|---|"]
    for r in ROUTES:
        acts = "/".join(str(a).replace("torch.", "") for a in r.acts) + (" -> int8" if r.act == "int8" else "")
        rows.append(f"| {r.layout.name} | {r.device} | {r.isa or '-'}{f' ({r.cpu})' if r.cpu else ''} | {'/'.join(map(str, r.bits))} | {r.groups} | {acts} | "
                    f"{_m_range(r)} | {r.why} |")
    return "\n".join(rows)


__all__ = ["ISA_LIBS", "LAYOUTS", "LIBS", "ROUTES", "Route", "choose_layout", "forced", "isa_unavailable",
           "kernel_for", "layout_named", "layout_unavailable", "rows_for", "table_markdown"]
