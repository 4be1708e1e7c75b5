"""Int8 activations, the opt-in of ``EMBEDQ_ACTIVATIONS=int8`` (4-bit tables only).

Per row and block of :data:`BLOCK` columns (llama.cpp's Q8_0, ONNX Runtime's accuracy
level 4): ``d = amax / 127``, ``q = round_half_even(x * (127 / amax))`` in float32, ``q = 0``
and ``d = 0`` for an all-zero block. The C kernel (``eq_q4a8.h``) computes the same codes;
this is its reference (tests) and what :func:`mode` reads.

Why opt-in and 4-bit only: the result is no longer ``x @ dequant(W)^T`` up to summation
order. On Gemma 3 270M the rounding adds +0.0003 mean KLD to Q4 g32's 0.121 (0.25 %), but
~0.0005 to int8 g64's 0.0005 (docs/performance.md), so 8-bit tables stay exact.
"""

from __future__ import annotations

import os

import torch

BLOCK = 32
MODES = ("exact", "int8")


def mode(value: str | None = None) -> str:
    """``value`` checked, or else ``EMBEDQ_ACTIVATIONS`` (``exact``, the default, or ``int8``),
    read when a table is prepared."""
    if value is not None:
        if value not in MODES:
            raise ValueError(f"activations={value!r}: not one of {', '.join(MODES)}")
        return value
    v = os.environ.get("EMBEDQ_ACTIVATIONS", "").strip().lower() or "exact"
    if v not in MODES:
        raise ValueError(f"EMBEDQ_ACTIVATIONS={v}: not one of {', '.join(MODES)}")
    return v


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (K a multiple of :data:`BLOCK`) -> codes int8 [M, K], block scales float32 [M, K / BLOCK]."""
    xf = x.float()
    xb = xf.reshape(xf.shape[0], -1, BLOCK)
    amax = xb.abs().amax(-1)
    pos = amax > 0
    inv = torch.where(pos, torch.tensor(127.0) / torch.where(pos, amax, 1.0), 0.0)
    q = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.reshape(xf.shape), amax / 127.0


def dequantize(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float32 activations the int8 kernel multiplies: ``q * d`` per block."""
    return (q.float().reshape(q.shape[0], -1, BLOCK) * d.unsqueeze(-1)).reshape(q.shape)


__all__ = ["BLOCK", "MODES", "dequantize", "mode", "quantize"]
