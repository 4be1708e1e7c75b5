"""Round-to-nearest quantization of a chunk of rows.

All quantizers here return signed integer codes ``q`` in ``[qmin, qmax]`` (int8),
scales already rounded to the storage dtype, and (asymmetric only) signed zero
points, with the contract ``x ≈ (q - zp) * scale`` evaluated in float32.
"""

from __future__ import annotations

import torch

from embedq.format.scheme import Scheme


def round_scale_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast positive float32 scales to ``dtype`` without ever rounding down.

    A scale rounded down would push the group's extreme value past ``qmax`` and
    clip it; rounding up keeps every element within half a step.
    """
    s = scale.to(dtype)
    if dtype == torch.float32:
        return s
    low = s.float() < scale
    if low.any():
        bits = s.view(torch.int16)
        # positive floats: the next representable value is the next bit pattern
        s = torch.where(low, (bits + 1).view(dtype), s)
    return s


def _grouped(x: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    rows, cols = x.shape
    g = scheme.effective_group(cols)
    return x.reshape(rows, cols // g, g)


def quantize_rtn(x: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype):
    """Quantize ``x`` ([rows, cols], any float dtype) with absmax / min-max scales.

    Returns ``(q, scale, zero_point)``; ``zero_point`` is None when symmetric.
    """
    xg = _grouped(x.float(), scheme)
    if scheme.symmetric:
        amax = xg.abs().amax(dim=-1)
        scale = amax / scheme.qmax
        scale = torch.where(amax > 0, scale, torch.ones_like(scale))
        scale_q = round_scale_up(scale, scale_dtype)
        q = torch.round(xg / scale_q.float().unsqueeze(-1))
        q = q.clamp_(scheme.qmin, scheme.qmax).to(torch.int8)
        return q.reshape(x.shape), scale_q, None
    # The range always contains 0 so that the zero point is representable
    # (compressed-tensors does the same).
    lo = xg.amin(dim=-1).clamp(max=0)
    hi = xg.amax(dim=-1).clamp(min=0)
    span = hi - lo
    levels = (1 << scheme.bits) - 1
    scale = torch.where(span > 0, span / levels, torch.ones_like(span))
    scale_q = round_scale_up(scale, scale_dtype)
    sf = scale_q.float()
    zp = torch.round(scheme.qmin - lo / sf).clamp_(scheme.qmin, scheme.qmax)
    q = torch.round(xg / sf.unsqueeze(-1)) + zp.unsqueeze(-1)
    q = q.clamp_(scheme.qmin, scheme.qmax).to(torch.int8)
    return q.reshape(x.shape), scale_q, zp.to(torch.int8)
