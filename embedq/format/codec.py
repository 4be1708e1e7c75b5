"""The one codec of the overlay format: packing, unpacking, dequantization, ``QuantizedTable``.

Every reader (verify, the transformers, vLLM and ONNX back ends) decodes through this
module; the fast serving paths in :mod:`embedq.kernels` are tested against it.

Dense little-endian packing, byte-identical to compressed-tensors' ``pack_to_int32``.

Code ``q`` is stored as ``u = q + 2^(bits-1)``; element ``i`` of a row occupies bits
``[i*bits, (i+1)*bits)`` of the row's bit stream. For 4 and 8 bits this is: bytes in
order, low nibble first — exactly ONNX Runtime's uint8 layout when viewed as bytes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from embedq.format.scheme import RowsCols
from embedq.format.scheme_units import unit_for

if sys.byteorder != "little":  # pragma: no cover - all supported hosts are little-endian
    raise ImportError("embedq's packing assumes a little-endian host")


def to_unsigned(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes (int8) to unsigned codes (uint8)."""
    return (q.to(torch.int16) + unit_for(bits).offset).to(torch.uint8)


def pack_bytes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [rows, cols] (uint8) to the packed byte table [rows, cols*bits/8]."""
    return unit_for(bits).pack_bytes(u)


def unpack_bytes(b: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Packed bytes [rows, cols*bits/8] to unsigned codes [rows, cols] (uint8)."""
    return unit_for(bits).unpack_bytes(b, cols)


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes [rows, cols] to ``weight_packed`` int32 [rows, cols*bits/32]."""
    rows, cols = q.shape
    if not unit_for(bits).fits(cols):
        raise ValueError(f"{cols} columns x {bits} bits is not a whole number of int32 words")
    return pack_bytes(to_unsigned(q, bits), bits).view(torch.int32)


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """``weight_packed`` int32 to signed codes [rows, cols] (int8)."""
    p = packed.contiguous()  # may keep odd strides on size-1 dims: view through 1-D
    u = unpack_bytes(p.reshape(-1).view(torch.uint8).reshape(p.shape[0], -1), bits, cols)
    return (u.to(torch.int16) - unit_for(bits).offset).to(torch.int8)


def packed_zero_point_rows(rows: int, bits: int) -> int:
    """Number of int32 rows of zero points packed along dim 0."""
    return unit_for(bits).zero_point_rows(rows)


def pack_zero_points(zp: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed zero points [rows, groups] packed along dim 0 (compressed-tensors layout).

    Returns int32 [ceil(rows*bits/32), groups]. Rows are padded with code 0 (u = 0)
    exactly as ``pack_to_int32`` pads.
    """
    rows, groups = zp.shape
    per_word = 32 // bits
    padded = -(-rows // per_word) * per_word
    u = to_unsigned(zp, bits).t()  # [groups, rows]
    if padded > rows:
        u = torch.nn.functional.pad(u, (0, padded - rows))
    # reshape(-1) first: a [1, n] tensor may keep a stride of 1 in dim 0, which
    # .view(torch.int32) refuses (per-row asymmetric tables have one group)
    packed = pack_bytes(u.contiguous(), bits).reshape(-1).view(torch.int32).reshape(groups, -1)
    # a fresh tensor: .contiguous() of a [n, 1] transpose keeps a stride of n in dim 1,
    # which later .view(torch.uint8) refuses
    out = torch.empty(packed.shape[1], groups, dtype=torch.int32)
    out.copy_(packed.t())
    return out


def unpack_zero_points(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Inverse of :func:`pack_zero_points`: signed int8 [rows, groups]."""
    return unpack_int32(packed.t().contiguous(), bits, packed.shape[0] * 32 // bits)[:, :rows].t().contiguous()


def dequantize_codes(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                     group_size: int | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - zp) * scale`` for signed codes ``q`` [rows, cols]; computed in float32."""
    rows, cols = q.shape
    g = cols if group_size is None else group_size
    qg = q.float().reshape(rows, cols // g, g)
    if zero_point is not None:
        qg = qg - zero_point.float().unsqueeze(-1)
    return (qg * scale.float().unsqueeze(-1)).reshape(rows, cols).to(dtype)


# Device-generic, shift-based row decoding (works on any device and under torch.compile);
# used by the back ends to decode selected rows without a CPU round trip.

def unpack_codes(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """``weight_packed`` rows (int32 [..., cols*bits/32]) to unsigned codes (int32 [..., cols]).

    Element ``i`` of a row occupies bits ``[i*bits, (i+1)*bits)`` of the row's little-endian
    bit stream, i.e. bits ``(i % pf) * bits`` of word ``i // pf`` (``pf = 32 // bits``).
    """
    pf = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    u = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return u.reshape(*packed.shape[:-1], packed.shape[-1] * pf)[..., :cols]


def signed_codes(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Signed codes ``u - 2^(bits-1)`` (int8 [..., cols]) of packed rows (int32 [..., W])."""
    b = packed.contiguous().view(torch.uint8)
    return unit_for(bits).signed_from_bytes(b)[..., :cols]


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                    bits: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize packed rows: ``(q - zp) * scale`` in float32, cast to ``dtype``.

    ``packed`` int32 [..., W]; ``scale`` [..., groups]; ``zero_point`` signed [..., groups]
    or None (symmetric). Same values as :func:`dequantize_codes` (the reference), read
    straight from the packed bytes on any device.
    """
    lead = packed.shape[:-1]
    groups = scale.shape[-1]
    g = cols // groups
    q = signed_codes(packed, bits, cols)
    if zero_point is None and dtype in (torch.bfloat16, torch.float16) and scale.dtype == dtype:
        # Half the memory traffic, same bits: a code (|q| <= 128) is exact in 16-bit floats,
        # and the kernels multiply half types in float32 and round once, exactly like the
        # float32 product cast to ``dtype`` below.
        x = q.to(dtype).reshape(*lead, groups, g)
        return x.mul_(scale.unsqueeze(-1)).reshape(*lead, cols)
    x = q.to(torch.float32).reshape(*lead, groups, g)
    if zero_point is not None:
        x = x - zero_point.to(torch.float32).unsqueeze(-1)
    x = x * scale.to(torch.float32).unsqueeze(-1)
    return x.reshape(*lead, cols).to(dtype)


def unpack_zero_point_rows(packed_zp: torch.Tensor, bits: int, start: int, count: int) -> torch.Tensor:
    """Rows ``[start, start+count)`` of compressed-tensors zero points (packed along dim 0).

    ``packed_zp`` int32 [ceil(rows*bits/32), groups]; returns signed int8 [count, groups].
    """
    pf = 32 // bits
    w0, w1 = start // pf, -(-(start + count) // pf)
    words = packed_zp[w0:w1].t().contiguous()                    # [groups, words]
    u = unpack_codes(words, bits, words.shape[-1] * pf)          # [groups, words*pf]
    u = u[:, start - w0 * pf: start - w0 * pf + count]
    return (u - (1 << (bits - 1))).t().to(torch.int8).contiguous()


def pack_zero_point_rows(zp: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    """Signed zero points [n, groups] (n <= rows) to the compressed-tensors layout for
    ``rows`` rows: int32 [ceil(rows*bits/32), groups], packed along dim 0; missing rows
    are stored as code 0 (u = 0), as ``pack_to_int32`` pads."""
    pf = 32 // bits
    words = -(-rows // pf)
    u = torch.zeros(words * pf, zp.shape[1], dtype=torch.int64, device=zp.device)
    u[: zp.shape[0]] = zp.to(torch.int64) + (1 << (bits - 1))
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=zp.device)
    w = (u.reshape(words, pf, -1) << shifts.reshape(1, pf, 1)).sum(dim=1)
    w = torch.where(w >= (1 << 31), w - (1 << 32), w)
    return w.to(torch.int32)


def zero_points_of(packed_zp: torch.Tensor, bits: int, ids: torch.Tensor) -> torch.Tensor:
    """Signed zero points (int32 [..., groups]) of rows ``ids`` from a packed-along-rows table."""
    pf = 32 // bits
    words = packed_zp[torch.div(ids, pf, rounding_mode="floor")]
    shift = ((ids % pf) * bits).to(torch.int32).unsqueeze(-1)
    return ((words >> shift) & ((1 << bits) - 1)) - (1 << (bits - 1))


@dataclass
class QuantizedTable(RowsCols):
    """One quantized module: ``weight_packed`` plus scales (and zero points).

    ``zero_point`` is kept unpacked (signed int8 [rows, groups]); use
    :meth:`packed_zero_point` for the compressed-tensors on-disk layout.
    """

    packed: torch.Tensor  # int32 [rows, cols*bits/32]
    scale: torch.Tensor  # [rows, groups], scale dtype
    zero_point: torch.Tensor | None  # int8 [rows, groups] signed, or None (symmetric)
    bits: int
    group_size: int | None  # None: one scale per row
    shape: tuple[int, int]

    @classmethod
    def from_codes(cls, q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                   bits: int, group_size: int | None) -> "QuantizedTable":
        return cls(pack_int32(q, bits), scale, zero_point, bits, group_size, tuple(q.shape))

    @property
    def symmetric(self) -> bool:
        return self.zero_point is None

    def codes(self, rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        """Signed codes for all rows or a selection of rows."""
        p = self.packed if rows is None else self.packed[rows]
        return unpack_int32(p, self.bits, self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32,
                   rows: slice | torch.Tensor | None = None) -> torch.Tensor:
        """Dequantized rows ``(q - zp) * scale`` (float32 math, cast to ``dtype``)."""
        sel = slice(None) if rows is None else rows
        zp = None if self.zero_point is None else self.zero_point[sel]
        return dequantize_codes(self.codes(rows), self.scale[sel], zp, self.group_size, dtype)

    def packed_zero_point(self) -> torch.Tensor | None:
        if self.zero_point is None:
            return None
        return pack_zero_points(self.zero_point, self.bits)

    @staticmethod
    def unpack_zero_point(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
        return unpack_zero_points(packed, bits, rows)

    def nbytes(self) -> int:
        n = self.packed.numel() * 4 + self.scale.numel() * self.scale.element_size() + 16
        if self.zero_point is not None:
            n += self.packed_zero_point().numel() * 4
        return n
