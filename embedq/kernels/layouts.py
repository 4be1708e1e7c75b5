"""The in-memory layouts of one quantized table, a class each, and the kernels that read them.

Like ggml-cpu's ``type_traits_cpu``: a layout class says which schemes and devices it can
hold (:meth:`Layout.check`), converts the overlay's tensors (:meth:`Layout.prepare`),
reads rows back (:meth:`Layout.rows`, :meth:`Layout.rows_range`: the gather and the
chunked reference read every layout through them), names the tensors it holds
(:attr:`Layout.holds`: bytes, device moves) and defines its kernels, functions
``(layout, x) -> logits`` that the rows of :data:`embedq.kernels.dispatch.ROUTES` hold.
Nothing compares layout names; ``name`` is for messages, docs and ``EMBEDQ_SERVE_KERNEL``.

Reference semantics (:meth:`embedq.format.codec.QuantizedTable.dequantize`): row ``r``,
column ``c`` is ``(q - zp) * scale`` in float32, ``q`` the signed code, ``zp`` the signed
zero point (0 when symmetric), ``scale``/``zp`` those of ``c``'s group. Every layout
stays the quantized size: conversion runs chunk by chunk, no float copy of the table is
made, and the reference kernel (:func:`chunked`) dequantizes a bounded chunk at a time.

torch's weight-only fallbacks (``int8_row``, ``int8_group``, ``int4_cpu``) are in
:mod:`embedq.kernels.torch_layouts`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from embedq.format.codec import dequantize_codes, unpack_int32
from embedq.kernels import actquant, native_f32, native_head, triton_head

# Elements of table decoded per chunk (the reference logits, and conversion at load).
CHUNK_ELEMS = 1 << 22
ROW_ALIGN = 64  # chunk steps are multiples of this (whole int4 tinygemm blocks)

warned: set[str] = set()


def warn_once(msg: str) -> None:
    """One RuntimeWarning per distinct fallback (serving loops would repeat it per call)."""
    if msg not in warned:
        warned.add(msg)
        warnings.warn(f"embedq fast path: {msg}", RuntimeWarning, stacklevel=3)


@dataclass
class Spec:
    """What every layout knows of the table it holds (``dtype``: the activation dtype
    serving will use; ``device`` and ``dtype`` follow :meth:`PreparedTable.move_`)."""

    rows: int
    cols: int
    bits: int
    group_size: int | None  # None: one scale per row
    symmetric: bool
    scale_dtype: torch.dtype
    dtype: torch.dtype
    device: torch.device

    @property
    def group(self) -> int:
        return self.cols if self.group_size is None else self.group_size

    @property
    def groups(self) -> int:
        return self.cols // self.group


class Refused(Exception):
    """:meth:`Layout.prepare` found that this layout cannot hold the table after all
    (a property of the values, not of the shape); the table is served chunked."""


class KernelFailed(Exception):
    """A kernel could not run on this device/driver; the table switches to chunked."""


class Layout:
    """One way of holding the table in memory (subclasses: one per layout)."""

    name: ClassVar[str]
    holds: ClassVar[tuple[str, ...]]  # attributes holding tensors (None allowed)
    torch_op: ClassVar[bool] = False  # served by torch's weight-only ops (EMBEDQ_SERVE_KERNEL=torch)

    def __init__(self, spec: Spec) -> None:
        self.spec = spec

    @staticmethod
    def check(spec: Spec) -> str | None:
        """None when this layout can hold a table of ``spec`` here, else why not."""
        return None

    def prepare(self, packed: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None) -> None:
        """Convert overlay tensors (packed int32 codes, scales [rows, groups], signed
        int8 zero points or None); raises :class:`Refused`."""
        raise NotImplementedError

    def rows(self, ids: torch.Tensor):
        """(signed codes int8 [n, K], scale [n, G], zp int8 [n, G] or None) of rows ``ids``."""
        raise NotImplementedError

    def rows_range(self, a: int, b: int):
        """Like :meth:`rows` for the contiguous rows ``a:b`` (layouts decode whole blocks)."""
        return self.rows(torch.arange(a, b, device=self.spec.device))

    def gather(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """A kernel's own gather of rows ``ids`` (any shape), or None: the reference gather."""
        return None

    def held(self) -> dict[str, torch.Tensor]:
        """The tensors this layout holds, by attribute (those set: a symmetric table has no
        zero points)."""
        return {n: t for n in self.holds if (t := getattr(self, n)) is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.held().values())

    def move_(self, fn) -> None:
        """Apply ``fn`` (``Module._apply``'s) to the held tensors; codes and scales keep
        their dtype (a cast would change the table)."""
        for n, t in self.held().items():
            setattr(self, n, fn(t).to(t.dtype))
        self.spec.device = next(iter(self.held().values())).device


# -- the reference arithmetic over any layout -----------------------------------------------

def dequantize_range(lay: Layout, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``a:b`` as [b-a, cols] ``dtype``: the reference arithmetic, bit-exact."""
    q, s, zp = lay.rows_range(a, b)
    sp = lay.spec
    if dtype in (torch.bfloat16, torch.float16) and s.dtype == dtype:
        # Half the traffic, same bits: q - zp (|.| <= 255) is exact in 16-bit floats and
        # torch multiplies half types in float32 with one rounding: exactly the float32
        # product of the reference cast to ``dtype``.
        n, g = q.shape[0], sp.group
        d = q if zp is None else q.to(torch.int16).view(n, -1, g) - zp.to(torch.int16).unsqueeze(-1)
        return (d.to(dtype).view(n, -1, g) * s.unsqueeze(-1)).view(n, sp.cols)
    return dequantize_codes(q, s, zp, sp.group_size, dtype)


def dequantize_rows(lay: Layout, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (1-D long) as [n, cols] ``dtype``: the reference arithmetic, bit-exact."""
    q, s, zp = lay.rows(ids)
    return dequantize_codes(q, s, zp, lay.spec.group_size, dtype)


def chunked(lay: Layout, x: torch.Tensor) -> torch.Tensor:
    """The reference kernel over any layout: decode a bounded chunk of rows, ``F.linear``."""
    dt, N = x.dtype, lay.spec.rows
    out = torch.empty(x.shape[0], N, dtype=dt, device=x.device)
    step = max(ROW_ALIGN, CHUNK_ELEMS // lay.spec.cols)
    for a in range(0, N, step):
        b = min(N, a + step)
        out[:, a:b] = F.linear(x, dequantize_range(lay, a, b, dt))
    return out


# -- the stored layout (the reference; Triton reads it as is) -------------------------------

class Chunked(Layout):
    """The on-disk layout as is: packed int32 codes, scales, signed int8 zero points."""

    name = "chunked"
    holds = ("packed", "scale", "zp")

    def prepare(self, packed, scale, zp) -> None:
        dev = self.spec.device
        self.packed = packed.to(dev).contiguous()
        self.scale = scale.to(dev).contiguous()
        self.zp = None if zp is None else zp.to(device=dev, dtype=torch.int8).contiguous()

    @classmethod
    def adopt(cls, other: "Chunked") -> "Chunked":
        """The same tensors served by the reference (a Triton table whose kernel failed)."""
        lay = cls(other.spec)
        lay.packed, lay.scale, lay.zp = other.packed, other.scale, other.zp
        return lay

    def rows(self, ids):
        return (unpack_int32(self.packed[ids], self.spec.bits, self.spec.cols), self.scale[ids],
                None if self.zp is None else self.zp[ids])


class Triton(Chunked):
    """CUDA with Triton (or forced on CPU tensors by ``EMBEDQ_SERVE_KERNEL=triton``, for
    ``TRITON_INTERPRET=1``): the stored layout, read by :mod:`embedq.kernels.triton_head`
    for logits and gathers."""

    name = "triton"

    @staticmethod
    def check(spec):
        return triton_head.available(spec.device) or triton_head.unsupported(spec.bits, spec.group_size, spec.cols)

    def _call(self, fn, a: torch.Tensor, **kw):
        sp = self.spec
        try:
            return fn(a, self.packed, self.scale, self.zp, bits=sp.bits, group_size=sp.group_size,
                      cols=sp.cols, **kw)
        except Exception as e:  # a Triton compile/launch failure on this GPU/driver
            if triton_head.forced():
                raise
            raise KernelFailed(f"Triton kernel {fn.__name__} failed on {a.device} ({type(e).__name__}: {e})") from e

    def logits(self, x):
        return self._call(triton_head.logits, x)

    def gather(self, ids, dtype):
        return self._call(triton_head.gather, ids.to(self.spec.device), dtype=dtype)


# -- embedq's own C kernels ----------------------------------------------------------------

class Native(Layout):
    """One blocked layout (16-row blocks, column pairs; :mod:`embedq.kernels.native_head`)
    for every scheme, read by embedq's C kernels (each weight byte once per call at every
    M: AVX512-BF16 ``vdpbf16ps``, AVX2+FMA, portable C) and by the gather."""

    name = "native"
    holds = ("w", "s", "z")
    SPAN = 2  # columns of a row per unit of the layout (native_head.pack)

    @staticmethod
    def check(spec):
        if spec.device.type != "cpu":
            return f"device {spec.device.type}"
        return native_head.supports(spec.bits, spec.cols, spec.group, spec.scale_dtype)

    def prepare(self, packed, scale, zp) -> None:
        sp = self.spec
        self.w, self.s, self.z = native_head.pack(packed, scale, zp, sp.bits, sp.cols,
                                                  max(native_head.BLOCK, CHUNK_ELEMS // sp.cols), self.SPAN)

    def rows(self, ids):
        sp = self.spec
        return (native_head.codes(self.w, sp.bits, ids, sp.cols), native_head.group_params(self.s, ids),
                None if self.z is None else native_head.group_params(self.z, ids))

    _gather_so = None  # the build serving gathers, chosen at the first (as the head's rows at load)

    def gather(self, ids, dtype):
        if ids.device.type != "cpu":
            return None
        if self._gather_so is None:
            self._gather_so = native_f32.gather_library() or False
        if not self._gather_so:
            return None
        sp = self.spec
        return native_f32.gather(self._gather_so, self.w, self.s, self.z, sp.bits, self.SPAN, sp.rows, sp.cols,
                                 sp.group, ids, dtype)

    def rows_range(self, a, b):
        B = native_head.BLOCK
        a0, b0 = a // B * B, -(-b // B) * B  # whole blocks
        q = native_head.block_codes(self.w[a0 // B: b0 // B], self.spec.bits, self.spec.cols)
        s = self.s[a0 // B: b0 // B].transpose(1, 2).reshape(b0 - a0, -1)
        z = None if self.z is None else self.z[a0 // B: b0 // B].transpose(1, 2).reshape(b0 - a0, -1)
        sl = slice(a - a0, b - a0)
        return q[sl], s[sl], None if z is None else z[sl]

    def head_bf16(self, x):
        sp = self.spec
        return native_head.head(self.w, self.s, self.z, sp.bits, sp.rows, sp.cols, sp.group, x)

    def head_amx(self, x):
        sp = self.spec
        return native_head.head_amx(self.w, self.s, self.z, sp.bits, sp.rows, sp.cols, sp.group, x)

    @staticmethod
    def fits_amx(spec) -> str | None:
        return native_head.amx_fits(spec.cols, spec.group)

    @staticmethod
    def head_f32(lib):
        """The fp32-FMA kernel of one build of ``native_f32.c`` (``lib``)."""
        def run(self: "Native", x):
            sp = self.spec
            return native_f32.head(lib, self.w, self.s, self.z, sp.bits, sp.rows, sp.cols, sp.group, x)
        return run

    @staticmethod
    def head_a8(lib):
        """4-bit codes x int8 activations (``EMBEDQ_ACTIVATIONS=int8``) of one build of
        ``native_f32.c``; activations holding inf or NaN take the exact kernel."""
        exact = Native.head_f32(lib)

        def run(self: "Native", x):
            sp = self.spec
            out = native_f32.head_a8(lib, self.w, self.s, self.z, sp.rows, sp.cols, sp.group, x)
            return exact(self, x) if out is None else out
        return run

    @staticmethod
    def fits_a8(spec) -> str | None:
        """Why the int8-activation rows cannot serve ``spec`` (None: they can)."""
        if spec.bits != 4:
            return "8-bit tables stay exact"
        return None if spec.group % 32 == 0 else f"group {spec.group} is not a multiple of 32"


class NativeQ4D(Native):
    """4-bit tables for the AVX2 kernels: the stored int32 words (8 columns of a row,
    column c at bits 4c) in 16-row blocks, ``[NB, K/8, 16]`` uint32 — Native's bytes, four to a
    unit; scales and zero points as Native. Its M = 1 kernel decodes 64 codes in 4 vector
    operations and no permute (eq_q4planes.h); M > 1 and the gather read the same values, so
    every output is the pair layout's bit for bit. Opt-in (``EMBEDQ_SERVE_KERNEL=native_q4d``, 4-bit tables): its
    rows come after the pair layout's, which every other row reads (AVX-512, BF16, AMX, the
    int8-activation rows); measured in docs/performance.md."""

    name = "native_q4d"
    SPAN = 8

    @staticmethod
    def check(spec):
        if spec.bits != 4:
            return f"{spec.bits}-bit codes (4-bit only)"
        why = Native.check(spec)
        if why is not None:
            return why
        if spec.cols % 8 or spec.group % 8:  # the format keeps both so (int32 words, groups of 8k)
            return f"columns/group ({spec.cols}/{spec.group}) not multiples of 8"
        if actquant.mode() == "int8":
            return "EMBEDQ_ACTIVATIONS=int8: those rows read the pair layout"
        return None


__all__ = ["CHUNK_ELEMS", "Chunked", "KernelFailed", "Layout", "Native", "NativeQ4D", "ROW_ALIGN", "Refused", "Spec",
           "Triton", "chunked", "dequantize_range", "dequantize_rows", "warn_once", "warned"]
