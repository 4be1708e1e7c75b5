"""Fast paths over one quantized table: logits ``x @ dequant(W)^T`` and row gathers.

A :class:`PreparedTable` is built once at load from the overlay's tensors (packed int32
codes, scales, optional zero points) and then serves both the head (:meth:`linear`) and
the embedding (:meth:`embedding`) of a tied model from ONE buffer. The in-memory layout
may differ from the on-disk one (it is what the kernel reads), but it stays the
quantized size: conversion runs chunk by chunk, and no float copy of the table is made,
neither at load nor per forward (fallbacks dequantize a bounded chunk of rows at a time).

Reference semantics (embedq.format.codec.QuantizedTable.dequantize): row ``r``,
column ``c`` is ``(q - zp) * scale`` in float32, ``q`` the signed code, ``zp`` the
signed zero point (0 when symmetric), ``scale``/``zp`` those of ``c``'s group.

Paths (``PreparedTable.kind``: the layout), chosen at prepare time by the one dispatch
table (:mod:`embedq.kernels.dispatch`), the kernel per call by activation dtype and M:

* ``native``     embedq's own C kernels over one blocked layout (16-row blocks, column
  pairs; the gather reads it too), every scheme, each weight byte read once per call at
  every M; the kernel per CPU variant (the dispatch table's ``isa``, chosen at load from
  ``build.cpu_flags()``): AVX512-BF16 ``vdpbf16ps`` for bf16 activations
  (:mod:`embedq.kernels.native_head`), AVX2+FMA and portable C for every activation dtype
  (:mod:`embedq.kernels.native_f32`). The default wherever a C compiler is found; the
  rows below are its fallbacks.
* ``triton``     CUDA with Triton installed (or forced on CPU tensors by
  ``EMBEDQ_SERVE_KERNEL=triton``, for ``TRITON_INTERPRET=1``): the on-disk layout kept
  as is (packed int32, scales, int8 zero points), read by the kernels of
  :mod:`embedq.kernels.triton_head` for both logits and gathers. A CUDA table without
  Triton, or a shape it does not take, falls to the rows below with a one-time warning;
  a compile/launch failure warns once and switches the table to chunked (same layout).
* ``int8_row``   8-bit, one scale per row: int8 codes [rows, cols]. CPU bf16 activations:
  ``torch._weight_int8pack_mm``; asymmetric adds the per-row correction
  ``- s*z*sum(x)``. CUDA: the same op, bf16/fp16 (UNTESTED: no GPU here; an error
  falls back to chunked dequantization with a warning).
* ``int8_group`` 8-bit groups: codes stored group-major [groups, rows, g] so each group
  is one contiguous int8 matrix; CPU bf16: one ``_weight_int8pack_mm`` per group,
  summed in float32 (plus the per-group zero-point correction). Correct but SLOW
  (the op's cost is per row, not per byte: ~4-8x bf16 on the Gemma head, batch 1);
  an inductor-compiled fused GEMV measured 0.92x bf16 there and is the next step.
* ``int4_cpu``   4-bit: torch's CPU tinygemm layout
  (``_convert_weight_to_int4pack_for_cpu``) with a ``[groups, rows, 2]`` scale/zero
  tensor in the prepared ``dtype``; ``_weight_int4pack_mm_for_cpu``. Per-row and
  groups larger than 256 are expressed as groups the op supports (scales repeated).
* ``chunked``    anything else: the on-disk layout, dequantized a bounded chunk of rows
  at a time (the reference arithmetic), with a one-time warning naming why a better
  layout was refused. Activations in a dtype a layout's kernel does not take (torch's CPU
  ops: bf16) run the same chunked arithmetic over that layout.

Memory: the native and Triton layouts hold the overlay's bytes (native: plus rows padded
to 16); the torch fallbacks int8 the same, int4 its interleaved [groups, rows, 2]
scale/zero pairs in the activation dtype and rows padded to 64.

Batch size: the native kernel reads each weight byte once per call at every M (measured
in docs/performance.md, "Serving speed"); torch's fallback ops re-decode the weights for
every 4 activation rows, so their time grows with the batch.
"""

from __future__ import annotations

import logging
import sys
import warnings

import torch
import torch.nn.functional as F

from embedq.format.codec import dequantize_codes, unpack_int32, unpack_zero_points
from embedq.format.scheme_units import INT4, INT8
from embedq.kernels import dispatch, native_f32, native_head, triton_head
from embedq.kernels.torch_int4 import int4_decode as _int4_decode
from embedq.kernels.torch_int4 import int4_layout as _int4_layout
from embedq.kernels.torch_int4 import int4_nibbles as _int4_nibbles

# Elements of table decoded per chunk (fallback logits, and conversion at load).
CHUNK_ELEMS = 1 << 22
_INT4_GROUPS = (256, 128, 64, 32)  # group sizes _weight_int4pack_mm_for_cpu accepts
_ROW_ALIGN = 64  # int4 rows are padded to this (a multiple of every tinygemm block)

_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(f"embedq fast path: {msg}", RuntimeWarning, stacklevel=3)


class _Stderr(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (which tests and notebooks replace)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


# The one line per load naming the kernel variant (INFO: users silence it with
# ``logging.getLogger("embedq.kernels").setLevel(logging.WARNING)``).
log = logging.getLogger("embedq.kernels")
if not log.handlers:
    _h = _Stderr()
    _h.setFormatter(logging.Formatter("embedq: %(message)s"))
    log.addHandler(_h)
    log.setLevel(logging.INFO)
    log.propagate = False
_said: set[str] = set()


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        log.info(msg)


def _is_cpu(device: torch.device) -> bool:
    return device.type == "cpu"


# ---------------------------------------------------------------------------------------


class PreparedTable:
    """One quantized table prepared for fast logits and gathers (see the module doc).

    Build with :meth:`from_table` or :meth:`from_packed`; ``dtype`` is the activation
    dtype serving will use (the int4 path stores its scales in it). Tied models: use
    the same object for the embedding and the head.
    """

    def __init__(self) -> None:  # use the constructors below
        self.kind = "chunked"
        self.reason: str | None = None
        self.routes: tuple[dispatch.Route, ...] = dispatch.rows_for("chunked")
        self.last_kernel: str | None = None  # the kernel the latest linear() ran (tests assert it)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_table(cls, qt, device=None, dtype: torch.dtype = torch.bfloat16,
                   prefer: str | None = None) -> "PreparedTable":
        """From an :class:`embedq.format.codec.QuantizedTable`."""
        return cls.from_packed(qt.packed, qt.scale, qt.cols, qt.bits, qt.group_size,
                               zero_point=qt.zero_point, device=device, dtype=dtype, prefer=prefer)

    @classmethod
    @torch.no_grad()
    def from_packed(cls, packed: torch.Tensor, scale: torch.Tensor, cols: int, bits: int,
                    group_size: int | None, zero_point: torch.Tensor | None = None,
                    zero_point_packed: torch.Tensor | None = None, device=None,
                    dtype: torch.dtype = torch.bfloat16, prefer: str | None = None) -> "PreparedTable":
        """From overlay tensors: ``packed`` int32 [rows, cols*bits/32], ``scale`` [rows, groups];
        zero points either signed int8 [rows, groups] (``zero_point``) or the
        compressed-tensors layout packed along rows (``zero_point_packed``).

        ``prefer="chunked"`` forces the fallback (tests, benchmarks).
        """
        if bits not in (4, 8):
            raise ValueError(f"unsupported bits {bits}")
        self = cls()
        rows = packed.shape[0]
        device = torch.device(device) if device is not None else packed.device
        if zero_point is None and zero_point_packed is not None:
            zero_point = unpack_zero_points(zero_point_packed.cpu(), bits, rows)
        g = cols if group_size is None else group_size
        if cols % g:
            raise ValueError(f"{cols} columns are not a whole number of groups of {g}")
        self.rows, self.cols, self.bits, self.group_size = rows, cols, bits, group_size
        self.group = g
        self.groups = cols // g
        self.symmetric = zero_point is None
        self.scale_dtype = scale.dtype
        self.dtype = dtype
        self.device = device
        if tuple(scale.shape) != (rows, self.groups):
            raise ValueError(f"scale has shape {list(scale.shape)}, expected {[rows, self.groups]}")

        if prefer == "chunked":
            self._prepare_chunked(packed, scale, zero_point, "requested")
            return self
        layout, refused = dispatch.choose_layout(self, self._check)
        if refused:  # a better layout for this device could not hold the table
            _warn_once(f"{'; '.join(refused)}; using {layout}")
        self.kind = layout
        self.routes = dispatch.rows_for(layout)
        if layout == "chunked":
            self._prepare_chunked(packed, scale, zero_point, "; ".join(refused) or "no kernel")
        elif layout == "native":
            self.w, self.s, self.z = native_head.pack(
                packed, scale, zero_point, self.bits, self.cols, max(native_head.BLOCK, CHUNK_ELEMS // self.cols))
        elif layout == "triton":
            self._prepare_chunked(packed, scale, zero_point, None)
            self.kind = "triton"
            self.routes = dispatch.rows_for("triton")
        else:
            self._prepare_fast(packed, scale, zero_point)
        if self.kind != "chunked" and device.type == "cpu":
            _say_once(f"{self.describe()}: {self.variants()}")
        return self

    def variants(self) -> str:
        """Which kernel serves which activation dtype, e.g. ``native_avx2 for bf16/f16/f32``."""
        seen, parts = set(), []
        for r in self.routes:
            acts = [a for a in r.acts if a not in seen]
            seen.update(acts)
            if acts:
                parts.append(f"{r.kernel} for {'/'.join(str(a).replace('torch.', '') for a in acts)}")
        return "; ".join(parts) or "chunked"

    def _check(self, layout: str) -> str | None:
        """None when ``layout`` can hold this table here, else why not (the dispatch asks)."""
        K, g, dev = self.cols, self.group, self.device
        if layout == "chunked":
            return None
        if layout == "native":
            if dev.type != "cpu":
                return f"device {dev.type}"
            return dispatch.layout_unavailable("native") or native_head.supports(self.bits, K, g, self.scale_dtype)
        if layout == "triton":
            return triton_head.available(dev) or triton_head.unsupported(self.bits, self.group_size, K)
        if layout in ("int8_row", "int8_group"):
            if K % 16 or g % 16:
                # torch's int8 kernel steps 16 columns at a time with aligned loads
                return f"int8 with {K} columns / groups of {g} (the int8 kernel needs multiples of 16)"
            if dev.type not in ("cpu", "cuda") or (layout == "int8_group" and dev.type != "cpu"):
                return f"device {dev.type}"
            return None
        # int4_cpu
        if not _is_cpu(dev):
            return f"device {dev.type}"
        if _int4_layout() is None:
            return "torch's CPU int4 layout could not be recognized"
        if K % 2:
            return f"4-bit with {K} columns"
        kg = next((s for s in _INT4_GROUPS if g % s == 0), None)
        if kg is None:
            return f"4-bit groups of {g} (the int4 kernel takes groups of 32, 64, 128 or 256)"
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"dtype {self.dtype}"
        self.kgroup = kg
        return None

    def _prepare_chunked(self, packed, scale, zero_point, why: str | None) -> None:
        """The on-disk layout as is (the chunked reference; Triton reads it too)."""
        self.kind = "chunked"
        self.routes = dispatch.rows_for("chunked")
        self.reason = why
        dev = self.device
        self.packed = packed.to(dev).contiguous()
        self.scale = scale.to(dev).contiguous()
        self.zp = None if zero_point is None else zero_point.to(device=dev, dtype=torch.int8).contiguous()

    def _prepare_fast(self, packed, scale, zero_point) -> None:
        dev, N, K = self.device, self.rows, self.cols
        step = max(_ROW_ALIGN, (CHUNK_ELEMS // K) // _ROW_ALIGN * _ROW_ALIGN)
        if self.kind in ("int8_row", "int8_group"):
            G, g = self.groups, self.group
            # signed codes u - 128 (the unit's decode: the same bytes, the same size)
            if self.kind == "int8_row":
                w8 = torch.empty(N, K, dtype=torch.int8, device=dev)
            else:
                w8 = torch.empty(G, N, g, dtype=torch.int8, device=dev)
            for a in range(0, N, step):
                b = min(N, a + step)
                q = INT8.signed_from_bytes(packed[a:b].contiguous().view(torch.uint8).reshape(b - a, K))
                if self.kind == "int8_row":
                    w8[a:b].copy_(q)
                else:
                    w8[:, a:b].copy_(q.reshape(b - a, G, g).transpose(0, 1))
            self.w8 = w8
            if self.kind == "int8_row":
                self.scale = scale.reshape(N).to(dev).contiguous()
                self.zp = None if zero_point is None else zero_point.reshape(N).to(dev, torch.int8).contiguous()
            else:
                self.scale = scale.t().to(dev).contiguous()  # [G, N]: one contiguous vector per group
                self.zp = None if zero_point is None else zero_point.t().to(dev, torch.int8).contiguous()
            return
        # int4_cpu
        B, _ = _int4_layout()
        kg = self.kgroup
        rep = self.group // kg
        self.rep = rep
        if not torch.equal(scale.to(self.dtype).to(scale.dtype), scale):
            # the kernel reads scales in the activation dtype: a lossy cast would change W
            why = f"{scale.dtype} scales are not exact in {self.dtype}"
            _warn_once(f"{why}: using chunked dequantization (slow)")
            self._prepare_chunked(packed, scale, zero_point, why)
            return
        Np = -(-N // _ROW_ALIGN) * _ROW_ALIGN
        self.rows_padded = Np
        conv = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        w4 = torch.empty(Np * K // 2, dtype=torch.uint8)
        sz = torch.zeros(K // kg, Np, 2, dtype=self.dtype)
        for a in range(0, Np, step):
            b = min(Np, a + step)
            u = torch.full((b - a, K), 8, dtype=torch.int32)  # padding rows: code 0, scale 0
            r = min(b, N) - a
            if r > 0:
                u[:r] = unpack_int32(packed[a:a + r], 4, K).to(torch.int32) + 8
            w4[a * K // 2: b * K // 2] = conv(u, 1).reshape(-1)
            if r <= 0:
                continue
            s = scale[a:a + r].float()
            if zero_point is None:
                zero = torch.zeros_like(s)
            else:
                # (q - zp) * s == q * s + (-zp * s); the kernel adds ``zero`` in float32 after
                # one rounding of -zp*s to ``dtype`` (see the tests for the bound)
                zero = -(zero_point[a:a + r].float() * s)
            s_d, z_d = s.to(self.dtype), zero.to(self.dtype)
            if zero_point is not None:
                back = self._zp_from(s_d, z_d)
                if not torch.equal(back, zero_point[a:a + r].to(torch.int8)):
                    why = f"zero points not recoverable from {self.dtype} scale*zero"
                    _warn_once(f"{why}: using chunked dequantization (slow)")
                    self._prepare_chunked(packed, scale, zero_point, why)
                    return
            sz[:, a:a + r, 0] = s_d.repeat_interleave(rep, dim=1).t()
            sz[:, a:a + r, 1] = z_d.repeat_interleave(rep, dim=1).t()
        self.w4 = w4.reshape(Np, K // 2)
        self.sz = sz

    @staticmethod
    def _zp_from(s: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """Signed zero points back from ``zero = -zp*s`` rounded to a 16-bit float.

        Exact: the rounding is relative 2^-9 at most (2^-12 fp16), times |zp| <= 8.
        A zero scale makes the zero point irrelevant ((q - zp) * 0 == 0).
        """
        sf = s.float()
        zp = torch.where(sf != 0, -zero.float() / torch.where(sf != 0, sf, torch.ones_like(sf)),
                         torch.zeros_like(sf))
        return torch.round(zp).to(torch.int8)

    def move_(self, fn) -> "PreparedTable":
        """Apply ``fn`` (a ``Module._apply`` function: a device or dtype move) to the held
        tensors, in place. Codes and scales keep their dtype (a cast would change the table),
        except the int4 layout's scale/zero pairs, which live in the activation dtype."""
        for k, v in list(vars(self).items()):
            if isinstance(v, torch.Tensor):
                setattr(self, k, fn(v) if self.kind == "int4_cpu" else fn(v).to(v.dtype))
        self.device = next(v for v in vars(self).values() if isinstance(v, torch.Tensor)).device
        if self.kind == "int4_cpu":
            self.dtype = self.sz.dtype
        return self

    # -- introspection --------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes held (codes, scales, zero points; int4 includes its row padding)."""
        names = {"int8_row": ("w8", "scale", "zp"), "int8_group": ("w8", "scale", "zp"),
                 "int4_cpu": ("w4", "sz"), "native": ("w", "s", "z"),
                 "chunked": ("packed", "scale", "zp"), "triton": ("packed", "scale", "zp")}[self.kind]
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in names) if t is not None)

    def describe(self) -> str:
        g = "row" if self.group_size is None else f"g{self.group_size}"
        extra = f" ({self.reason})" if self.reason else ""
        return (f"{self.rows}x{self.cols} int{self.bits} {g} {'sym' if self.symmetric else 'asym'} "
                f"-> {self.kind}{extra} on {self.device}")

    # -- rows (gather, and the chunked fallback) ------------------------------------------
    def _rows(self, ids: torch.Tensor):
        """(signed codes int8 [n, K], scale [n, G], zp int8 [n, G] or None) of rows ``ids``."""
        kind = self.kind
        if kind == "native":
            q = native_head.codes(self.w, self.bits, ids, self.cols)
            s = native_head.group_params(self.s, ids)
            zp = None if self.z is None else native_head.group_params(self.z, ids)
        elif kind == "int8_row":
            q = self.w8[ids]
            s = self.scale[ids].unsqueeze(1)
            zp = None if self.zp is None else self.zp[ids].unsqueeze(1)
        elif kind == "int8_group":
            q = self.w8[:, ids].transpose(0, 1).reshape(-1, self.cols)
            s = self.scale[:, ids].t()
            zp = None if self.zp is None else self.zp[:, ids].t()
        elif kind == "int4_cpu":
            B, pos = _int4_layout()
            q = (_int4_decode(self.w4, B, pos, ids, self.cols).to(torch.int8) - 8)
            szr = self.sz[:: self.rep, ids]  # [G, n, 2] in self.dtype
            s_d = szr[..., 0].t()
            zp = None if self.symmetric else self._zp_from(s_d, szr[..., 1].t())
            s = s_d.to(self.scale_dtype)  # exact: checked at prepare time
        else:
            q = unpack_int32(self.packed[ids], self.bits, self.cols)
            s = self.scale[ids]
            zp = None if self.zp is None else self.zp[ids]
        return q, s, zp

    def _rows_range(self, a: int, b: int):
        """Like :meth:`_rows` for the contiguous rows ``a:b``, decoding whole blocks (fast)."""
        kind, K = self.kind, self.cols
        if kind == "native":
            B = native_head.BLOCK
            a0, b0 = a // B * B, -(-b // B) * B  # whole blocks
            w = self.w[a0 // B: b0 // B]
            if self.bits == 8:
                q = w.transpose(1, 2).reshape(b0 - a0, K)
            else:
                q = INT4.signed_from_bytes(w.transpose(1, 2).reshape(b0 - a0, K // 2))
            s = self.s[a0 // B: b0 // B].transpose(1, 2).reshape(b0 - a0, -1)
            z = None if self.z is None else self.z[a0 // B: b0 // B].transpose(1, 2).reshape(b0 - a0, -1)
            sl = slice(a - a0, b - a0)
            return q[sl], s[sl], None if z is None else z[sl]
        if kind == "int4_cpu":
            B, pos = _int4_layout()
            a0, b0 = a // B * B, -(-b // B) * B  # whole blocks (rows are padded to 64)
            blocks = self.w4[a0:b0].reshape((b0 - a0) // B, K, B // 2)
            nib = _int4_nibbles(blocks)[:, :, pos]  # [blocks, K, B] in row order
            q = nib.transpose(1, 2).reshape(b0 - a0, K)[a - a0: b - a0].view(torch.int8) - 8
            szr = self.sz[:: self.rep, a:b]
            s_d = szr[..., 0].t()
            zp = None if self.symmetric else self._zp_from(s_d, szr[..., 1].t())
            return q, s_d.to(self.scale_dtype), zp
        if kind == "int8_group":
            q = self.w8[:, a:b].transpose(0, 1).reshape(b - a, K)
            s = self.scale[:, a:b].t()
            return q, s, None if self.zp is None else self.zp[:, a:b].t()
        if kind == "int8_row":
            return (self.w8[a:b], self.scale[a:b].unsqueeze(1),
                    None if self.zp is None else self.zp[a:b].unsqueeze(1))
        return self._rows(torch.arange(a, b, device=self.device))

    def dequantize_range(self, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``a:b`` as [b-a, cols] ``dtype``: the reference arithmetic, bit-exact."""
        q, s, zp = self._rows_range(a, b)
        if dtype in (torch.bfloat16, torch.float16) and s.dtype == dtype:
            # Half the traffic, same bits: q - zp (|.| <= 255) is exact in 16-bit floats and
            # torch multiplies half types in float32 with one rounding: exactly the float32
            # product of the reference cast to ``dtype``.
            n, g = q.shape[0], self.group
            d = q if zp is None else q.to(torch.int16).view(n, -1, g) - zp.to(torch.int16).unsqueeze(-1)
            return (d.to(dtype).view(n, -1, g) * s.unsqueeze(-1)).view(n, self.cols)
        return dequantize_codes(q, s, zp, self.group_size, dtype)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (1-D long) as [n, cols] ``dtype``: the reference arithmetic, bit-exact."""
        q, s, zp = self._rows(ids)
        return dequantize_codes(q, s, zp, self.group_size, dtype)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantized rows for token ids of any shape: [..., cols] in ``dtype`` (default: ``self.dtype``)."""
        dtype = self.dtype if dtype is None else dtype
        if self.kind == "triton":
            out = self._triton_call(triton_head.gather, ids.to(self.device), dtype=dtype)
            if out is not None:
                return out
        flat = ids.reshape(-1).to(device=self.device, dtype=torch.long)
        out = torch.empty(flat.numel(), self.cols, dtype=dtype, device=self.device)
        step = max(1, CHUNK_ELEMS // self.cols)
        for a in range(0, flat.numel(), step):  # bounded transient (int4 index tensors)
            out[a:a + step] = self.dequantize_rows(flat[a:a + step], dtype)
        return out.view(*ids.shape, self.cols)

    # -- logits -----------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ dequant(W)^T (+ bias)`` for x [..., cols] in any float dtype; output in x's dtype."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.cols)
        if x2.shape[0] == 0:
            out = x2.new_empty(0, self.rows)
        else:
            out = self._linear2d(x2)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.view(*lead, self.rows)

    __call__ = linear

    def kernel_for(self, x: torch.Tensor) -> str:
        """The name of the kernel :meth:`linear` runs for activations ``x`` [M, cols]."""
        r = dispatch.kernel_for(self.routes, x.reshape(-1, self.cols))
        return "chunked" if r is None else r.kernel

    def _linear2d(self, x: torch.Tensor) -> torch.Tensor:
        name = self.kernel_for(x)
        self.last_kernel = name
        return KERNELS[name](self, x)

    def _linear_native(self, x: torch.Tensor) -> torch.Tensor:
        return native_head.head(self.w, self.s, self.z, self.bits, self.rows, self.cols, self.group, x)

    def _linear_native_f32(self, variant: str, x: torch.Tensor) -> torch.Tensor:
        return native_f32.head(variant, self.w, self.s, self.z, self.bits, self.rows, self.cols, self.group, x)

    def _linear_triton(self, x: torch.Tensor) -> torch.Tensor:
        out = self._triton_call(triton_head.logits, x)
        return self._linear_chunked(x) if out is None else out

    def _triton_call(self, fn, a: torch.Tensor, **kw):
        """``fn`` of :mod:`triton_head` on this table; None (warned once) if it fails to run,
        unless ``EMBEDQ_SERVE_KERNEL=triton`` forces it (then the error propagates)."""
        try:
            return fn(a, self.packed, self.scale, self.zp, bits=self.bits,
                      group_size=self.group_size, cols=self.cols, **kw)
        except Exception as e:  # a Triton compile/launch failure on this GPU/driver
            if triton_head.forced():
                raise
            self.reason = f"Triton kernel {fn.__name__} failed on {a.device} ({type(e).__name__}: {e})"
            _warn_once(f"{self.reason}; using chunked dequantization")
            self.kind = "chunked"  # same stored layout: the fallback reads it as is
            self.routes = dispatch.rows_for("chunked")
            return None

    @staticmethod
    def _aligned(x: torch.Tensor) -> torch.Tensor:
        # torch's CPU int8 kernel loads activations with aligned 256-bit loads
        x = x.contiguous()
        if x.data_ptr() % 64:
            x = x.clone()
        return x

    def _linear_int8_row(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x = self._aligned(x)
        try:
            y = torch._weight_int8pack_mm(x, self.w8, self.scale.to(dt))
        except (RuntimeError, NotImplementedError) as e:  # e.g. a CUDA build without the op
            _warn_once(f"_weight_int8pack_mm failed on {x.device} ({e}); using chunked dequantization")
            return self._linear_chunked(x)
        if self.zp is None:
            return y
        # (q - z) s . x = s (q . x) - s z sum(x): one per-row correction, in float32
        # (one fused addcmul: the spelled-out expression measured ~100x slower here)
        return torch.addcmul(y.float(), x.float().sum(dim=1, keepdim=True),
                             self.scale.float() * self.zp, value=-1).to(dt)

    def _linear_int8_group(self, x: torch.Tensor) -> torch.Tensor:
        dt, g = x.dtype, self.group
        acc = torch.zeros(x.shape[0], self.rows, dtype=torch.float32, device=x.device)
        for j in range(self.groups):
            xj = self._aligned(x[:, j * g:(j + 1) * g])
            acc += torch._weight_int8pack_mm(xj, self.w8[j], self.scale[j].to(dt))
            if self.zp is not None:
                acc.addcmul_(xj.float().sum(dim=1, keepdim=True), self.scale[j].float() * self.zp[j], value=-1)
        return acc.to(dt)

    def _linear_int4_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:  # the kernel reads scales in x's dtype
            return self._linear_chunked(x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.w4, self.kgroup, self.sz)
        if self.rows_padded != self.rows:
            y = y[:, : self.rows].contiguous()
        return y

    def _linear_chunked(self, x: torch.Tensor) -> torch.Tensor:
        dt, N = x.dtype, self.rows
        out = torch.empty(x.shape[0], N, dtype=dt, device=x.device)
        step = max(_ROW_ALIGN, CHUNK_ELEMS // self.cols)
        for a in range(0, N, step):
            b = min(N, a + step)
            out[:, a:b] = F.linear(x, self.dequantize_range(a, b, dt))
        return out


# Kernel names of the dispatch table's rows -> the function running them (one place).
KERNELS = {
    "native_bf16": PreparedTable._linear_native,
    "native_avx2": lambda t, x: t._linear_native_f32("avx2", x),
    "native_portable": lambda t, x: t._linear_native_f32("portable", x),
    "triton": PreparedTable._linear_triton,
    "int8_row": PreparedTable._linear_int8_row,
    "int8_group": PreparedTable._linear_int8_group,
    "int4_cpu": PreparedTable._linear_int4_cpu,
    "chunked": PreparedTable._linear_chunked,
}
assert {r.kernel for r in dispatch.ROUTES} <= set(KERNELS), "a dispatch row without a kernel"
