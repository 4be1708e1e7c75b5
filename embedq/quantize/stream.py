"""Streaming over the rows of a table: read a chunk, quantize it, hand it on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from embedq.quantize.rtn import dequantize_codes, quantize_rtn
from embedq.quantize.scheme import Scheme

# About 8 MiB of source per chunk keeps temporaries in cache-friendly sizes and the
# peak memory independent of the table size.
TARGET_CHUNK_BYTES = 8 << 20
ROW_ALIGN = 64  # zero points are packed along rows: keep chunks word-aligned for any bits


def default_chunk_rows(cols: int, itemsize: int) -> int:
    rows = max(ROW_ALIGN, TARGET_CHUNK_BYTES // max(1, cols * itemsize))
    return rows // ROW_ALIGN * ROW_ALIGN


def quantize_chunk(x: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype):
    """Quantize one chunk of rows with the scheme's method: ``(q, scale, zp)``."""
    if scheme.method == "mse":
        from embedq.quantize.mse import quantize_mse
        return quantize_mse(x, scheme, scale_dtype)
    return quantize_rtn(x, scheme, scale_dtype)


@dataclass
class Chunk:
    row: int
    source: torch.Tensor  # the rows as read
    q: torch.Tensor  # signed codes, int8
    scale: torch.Tensor
    zero_point: torch.Tensor | None


@dataclass
class ErrorStats:
    """Reconstruction error accumulated over chunks."""

    max_abs: float = 0.0
    sq_err: float = 0.0
    sq_ref: float = 0.0
    count: int = 0

    def update(self, x: torch.Tensor, xhat: torch.Tensor) -> None:
        d = xhat - x
        self.max_abs = max(self.max_abs, float(d.abs().max()))
        self.sq_err += float((d.double() ** 2).sum())
        self.sq_ref += float((x.double() ** 2).sum())
        self.count += x.numel()

    @property
    def rms(self) -> float:
        return (self.sq_err / self.count) ** 0.5 if self.count else 0.0

    @property
    def rel_rms(self) -> float:
        return (self.sq_err / self.sq_ref) ** 0.5 if self.sq_ref else 0.0


def iter_quantized(read_rows: Callable[[int, int], torch.Tensor], shape: tuple[int, int],
                   scheme: Scheme, scale_dtype: torch.dtype, chunk_rows: int,
                   stats: ErrorStats | None = None) -> Iterator[Chunk]:
    """Quantize ``shape[0]`` rows ``chunk_rows`` at a time; ``read_rows(a, b)`` reads rows a..b."""
    rows, _ = shape
    if chunk_rows % ROW_ALIGN:
        raise ValueError(f"chunk_rows must be a multiple of {ROW_ALIGN}")
    for r0 in range(0, rows, chunk_rows):
        r1 = min(rows, r0 + chunk_rows)
        x = read_rows(r0, r1)
        q, scale, zp = quantize_chunk(x, scheme, scale_dtype)
        if stats is not None:
            xf = x.float()
            stats.update(xf, dequantize_codes(q, scale, zp, scheme.group_size))
        yield Chunk(r0, x, q, scale, zp)
