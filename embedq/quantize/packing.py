"""Dense little-endian packing, byte-identical to compressed-tensors' ``pack_to_int32``.

Code ``q`` is stored as ``u = q + 2^(bits-1)``; element ``i`` of a row occupies bits
``[i*bits, (i+1)*bits)`` of the row's bit stream. For 4 and 8 bits this is: bytes in
order, low nibble first — exactly ONNX Runtime's uint8 layout when viewed as bytes.
"""

from __future__ import annotations

import sys

import torch

if sys.byteorder != "little":  # pragma: no cover - all supported hosts are little-endian
    raise ImportError("embedq's packing assumes a little-endian host")


def to_unsigned(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes (int8) to unsigned codes (uint8)."""
    return (q.to(torch.int16) + (1 << (bits - 1))).to(torch.uint8)


def pack_bytes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [rows, cols] (uint8) to the packed byte table [rows, cols*bits/8]."""
    if bits == 8:
        return u.contiguous()
    if bits == 4:
        return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()
    raise ValueError(f"unsupported bits {bits}")


def unpack_bytes(b: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Packed bytes [rows, cols*bits/8] to unsigned codes [rows, cols] (uint8)."""
    if bits == 8:
        return b[:, :cols]
    if bits == 4:
        out = torch.empty(b.shape[0], b.shape[1] * 2, dtype=torch.uint8, device=b.device)
        out[:, 0::2] = b & 0x0F
        out[:, 1::2] = b >> 4
        return out[:, :cols]
    raise ValueError(f"unsupported bits {bits}")


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes [rows, cols] to ``weight_packed`` int32 [rows, cols*bits/32]."""
    rows, cols = q.shape
    if (cols * bits) % 32:
        raise ValueError(f"{cols} columns x {bits} bits is not a whole number of int32 words")
    return pack_bytes(to_unsigned(q, bits), bits).view(torch.int32)


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """``weight_packed`` int32 to signed codes [rows, cols] (int8)."""
    p = packed.contiguous()  # may keep odd strides on size-1 dims: view through 1-D
    u = unpack_bytes(p.reshape(-1).view(torch.uint8).reshape(p.shape[0], -1), bits, cols)
    return (u.to(torch.int16) - (1 << (bits - 1))).to(torch.int8)


def packed_zero_point_rows(rows: int, bits: int) -> int:
    """Number of int32 rows of zero points packed along dim 0."""
    return -(-rows * bits // 32)


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
