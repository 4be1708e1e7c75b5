"""An in-memory quantized table in the overlay's on-disk representation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embedq.quantize.packing import pack_int32, pack_zero_points, unpack_int32, unpack_zero_points
from embedq.quantize.rtn import dequantize_codes


@dataclass
class QuantizedTable:
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
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

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
