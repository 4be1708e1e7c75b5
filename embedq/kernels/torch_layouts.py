"""torch's weight-only CPU/CUDA ops as layouts: the fallbacks where no C compiler runs.

* ``int8_row``   8-bit, one scale per row: int8 codes [rows, cols]; ``_weight_int8pack_mm``
  (CPU bf16; CUDA UNTESTED: no GPU here, an error falls back to the reference with a
  warning); asymmetric adds the per-row correction ``- s*z*sum(x)``.
* ``int8_group`` 8-bit groups, codes group-major [groups, rows, g]: one
  ``_weight_int8pack_mm`` per group summed in float32 — correct but SLOW (the op's cost
  is per row, not per byte).
* ``int4_cpu``   4-bit: torch's CPU tinygemm layout (``_convert_weight_to_int4pack_for_cpu``)
  with ``[groups, rows, 2]`` scale/zero pairs in the activation dtype, rows padded to 64;
  per-row and groups over 256 are expressed as groups the op takes (scales repeated).

torch's ops decode the weights again for every 4 activation rows: their time grows with M.
"""

from __future__ import annotations

import torch

from embedq.format.codec import unpack_int32
from embedq.format.scheme_units import INT8
from embedq.kernels import layouts
from embedq.kernels.layouts import ROW_ALIGN, Layout, Refused, chunked, warn_once
from embedq.kernels.torch_int4 import int4_decode, int4_layout, int4_nibbles

_INT4_GROUPS = (256, 128, 64, 32)  # group sizes _weight_int4pack_mm_for_cpu accepts


def _step(spec) -> int:
    return max(ROW_ALIGN, (layouts.CHUNK_ELEMS // spec.cols) // ROW_ALIGN * ROW_ALIGN)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    # torch's CPU int8 kernel loads activations with aligned 256-bit loads
    x = x.contiguous()
    return x.clone() if x.data_ptr() % 64 else x


class _Int8(Layout):
    holds = ("w8", "scale", "zp")
    torch_op = True

    @classmethod
    def check(cls, spec):
        if spec.cols % 16 or spec.group % 16:
            # torch's int8 kernel steps 16 columns at a time with aligned loads
            return f"int8 with {spec.cols} columns / groups of {spec.group} (the int8 kernel needs multiples of 16)"
        return None if spec.device.type in cls.devices else f"device {spec.device.type}"

    def _codes(self, packed):
        """Signed codes [rows, cols] chunk by chunk (the unit's decode: same bytes, same size)."""
        sp = self.spec
        for a in range(0, sp.rows, _step(sp)):
            b = min(sp.rows, a + _step(sp))
            yield a, b, INT8.signed_from_bytes(packed[a:b].contiguous().view(torch.uint8).reshape(b - a, sp.cols))


class Int8Row(_Int8):
    name = "int8_row"
    devices = ("cpu", "cuda")

    def prepare(self, packed, scale, zp) -> None:
        sp, dev = self.spec, self.spec.device
        self.w8 = torch.empty(sp.rows, sp.cols, dtype=torch.int8, device=dev)
        for a, b, q in self._codes(packed):
            self.w8[a:b].copy_(q)
        self.scale = scale.reshape(sp.rows).to(dev).contiguous()
        self.zp = None if zp is None else zp.reshape(sp.rows).to(dev, torch.int8).contiguous()

    def rows(self, ids):
        return (self.w8[ids], self.scale[ids].unsqueeze(1),
                None if self.zp is None else self.zp[ids].unsqueeze(1))

    def rows_range(self, a, b):
        return (self.w8[a:b], self.scale[a:b].unsqueeze(1),
                None if self.zp is None else self.zp[a:b].unsqueeze(1))

    def mm(self, x):
        dt = x.dtype
        x = _aligned(x)
        try:
            y = torch._weight_int8pack_mm(x, self.w8, self.scale.to(dt))
        except (RuntimeError, NotImplementedError) as e:  # e.g. a CUDA build without the op
            warn_once(f"_weight_int8pack_mm failed on {x.device} ({e}); using chunked dequantization")
            return chunked(self, x)
        if self.zp is None:
            return y
        # (q - z) s . x = s (q . x) - s z sum(x): one per-row correction, in float32
        # (one fused addcmul: the spelled-out expression measured ~100x slower here)
        return torch.addcmul(y.float(), x.float().sum(dim=1, keepdim=True),
                             self.scale.float() * self.zp, value=-1).to(dt)


class Int8Group(_Int8):
    name = "int8_group"
    devices = ("cpu",)

    def prepare(self, packed, scale, zp) -> None:
        sp, dev = self.spec, self.spec.device
        G, g = sp.groups, sp.group
        self.w8 = torch.empty(G, sp.rows, g, dtype=torch.int8, device=dev)
        for a, b, q in self._codes(packed):
            self.w8[:, a:b].copy_(q.reshape(b - a, G, g).transpose(0, 1))
        self.scale = scale.t().to(dev).contiguous()  # [G, N]: one contiguous vector per group
        self.zp = None if zp is None else zp.t().to(dev, torch.int8).contiguous()

    def rows(self, ids):
        return (self.w8[:, ids].transpose(0, 1).reshape(-1, self.spec.cols), self.scale[:, ids].t(),
                None if self.zp is None else self.zp[:, ids].t())

    def rows_range(self, a, b):
        return (self.w8[:, a:b].transpose(0, 1).reshape(b - a, self.spec.cols), self.scale[:, a:b].t(),
                None if self.zp is None else self.zp[:, a:b].t())

    def mm(self, x):
        dt, g, sp = x.dtype, self.spec.group, self.spec
        acc = torch.zeros(x.shape[0], sp.rows, dtype=torch.float32, device=x.device)
        for j in range(sp.groups):
            xj = _aligned(x[:, j * g:(j + 1) * g])
            acc += torch._weight_int8pack_mm(xj, self.w8[j], self.scale[j].to(dt))
            if self.zp is not None:
                acc.addcmul_(xj.float().sum(dim=1, keepdim=True), self.scale[j].float() * self.zp[j], value=-1)
        return acc.to(dt)


def zp_from(s: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Signed zero points back from ``zero = -zp*s`` rounded to a 16-bit float.

    Exact: the rounding is relative 2^-9 at most (2^-12 fp16), times |zp| <= 8.
    A zero scale makes the zero point irrelevant ((q - zp) * 0 == 0).
    """
    sf = s.float()
    zp = torch.where(sf != 0, -zero.float() / torch.where(sf != 0, sf, torch.ones_like(sf)),
                     torch.zeros_like(sf))
    return torch.round(zp).to(torch.int8)


class Int4Cpu(Layout):
    name = "int4_cpu"
    holds = ("w4", "sz")
    torch_op = True

    @staticmethod
    def kernel_group(group: int) -> int | None:
        """The largest group the op takes that divides ``group`` (scales repeat over it)."""
        return next((s for s in _INT4_GROUPS if group % s == 0), None)

    @classmethod
    def check(cls, spec):
        if spec.device.type != "cpu":
            return f"device {spec.device.type}"
        if int4_layout() is None:
            return "torch's CPU int4 layout could not be recognized"
        if spec.cols % 2:
            return f"4-bit with {spec.cols} columns"
        if cls.kernel_group(spec.group) is None:
            return f"4-bit groups of {spec.group} (the int4 kernel takes groups of 32, 64, 128 or 256)"
        if spec.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"dtype {spec.dtype}"
        return None

    def prepare(self, packed, scale, zp) -> None:
        sp = self.spec
        N, K, dt = sp.rows, sp.cols, sp.dtype
        self.kgroup = self.kernel_group(sp.group)
        self.rep = rep = sp.group // self.kgroup
        if not torch.equal(scale.to(dt).to(scale.dtype), scale):
            # the kernel reads scales in the activation dtype: a lossy cast would change W
            raise Refused(f"{scale.dtype} scales are not exact in {dt}")
        self.rows_padded = Np = -(-N // ROW_ALIGN) * ROW_ALIGN
        conv = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        w4 = torch.empty(Np * K // 2, dtype=torch.uint8)
        sz = torch.zeros(K // self.kgroup, Np, 2, dtype=dt)
        step = _step(sp)
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
            # (q - zp) * s == q * s + (-zp * s); the kernel adds ``zero`` in float32 after
            # one rounding of -zp*s to ``dtype`` (see the tests for the bound)
            zero = torch.zeros_like(s) if zp is None else -(zp[a:a + r].float() * s)
            s_d, z_d = s.to(dt), zero.to(dt)
            if zp is not None and not torch.equal(zp_from(s_d, z_d), zp[a:a + r].to(torch.int8)):
                raise Refused(f"zero points not recoverable from {dt} scale*zero")
            sz[:, a:a + r, 0] = s_d.repeat_interleave(rep, dim=1).t()
            sz[:, a:a + r, 1] = z_d.repeat_interleave(rep, dim=1).t()
        self.w4 = w4.reshape(Np, K // 2)
        self.sz = sz

    def _params(self, szr):
        s_d = szr[..., 0].t()
        zp = None if self.spec.symmetric else zp_from(s_d, szr[..., 1].t())
        return s_d.to(self.spec.scale_dtype), zp  # exact: checked at prepare time

    def rows(self, ids):
        B, pos = int4_layout()
        q = int4_decode(self.w4, B, pos, ids, self.spec.cols).to(torch.int8) - 8
        return (q, *self._params(self.sz[:: self.rep, ids]))

    def rows_range(self, a, b):
        B, pos = int4_layout()
        K = self.spec.cols
        a0, b0 = a // B * B, -(-b // B) * B  # whole blocks (rows are padded to 64)
        blocks = self.w4[a0:b0].reshape((b0 - a0) // B, K, B // 2)
        nib = int4_nibbles(blocks)[:, :, pos]  # [blocks, K, B] in row order
        q = nib.transpose(1, 2).reshape(b0 - a0, K)[a - a0: b - a0].view(torch.int8) - 8
        return (q, *self._params(self.sz[:: self.rep, a:b]))

    def move_(self, fn) -> None:
        # the scale/zero pairs live in the activation dtype: a dtype move converts them
        self.w4, self.sz = fn(self.w4).to(self.w4.dtype), fn(self.sz)
        self.spec.device, self.spec.dtype = self.w4.device, self.sz.dtype

    def mm(self, x):
        if x.dtype != self.spec.dtype:  # the kernel reads scales in x's dtype
            return chunked(self, x)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.w4, self.kgroup, self.sz)
        return y[:, : self.spec.rows].contiguous() if self.rows_padded != self.spec.rows else y


__all__ = ["Int4Cpu", "Int8Group", "Int8Row", "zp_from"]
