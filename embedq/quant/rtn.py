"""Round-to-nearest quantization of a chunk of rows.

All quantizers here return signed integer codes ``q`` in ``[qmin, qmax]`` (int8),
scales already rounded to the storage dtype, and (asymmetric only) signed zero
points, with the contract ``x ≈ (q - zp) * scale`` evaluated in float32.

Symmetric 8-bit scales are ``absmax / 127``. Symmetric 4-bit scales use the signed-max
mapping (llama.cpp's Q4_0, the onnxruntime-genai builder's int4 RTN): ``scale = m / -8``
with ``m`` the group's element of largest magnitude, sign kept, so ``m`` lands on code
-8 and all 16 codes are used; the scale is negative when ``m`` is. Measured on Gemma 3
270M it beats ``absmax / 7`` on the same bytes (docs/methods.md). Decoders are unchanged:
``x = q * scale`` whatever the sign.
"""

from __future__ import annotations

import torch

from embedq.format.scheme import Scheme


def round_scale_up(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast float32 scales to ``dtype`` without ever rounding their magnitude down.

    A scale rounded down would push the group's extreme value past ``qmax`` and
    clip it; rounding up keeps every element within half a step.
    """
    s = scale.to(dtype)
    if dtype == torch.float32:
        return s
    low = s.float().abs() < scale.abs()
    if low.any():
        bits = s.view(torch.int16)
        # sign-magnitude floats: the next larger magnitude is the next bit pattern
        s = torch.where(low, (bits + 1).view(dtype), s)
    return s


def _grouped(x: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    rows, cols = x.shape
    g = scheme.effective_group(cols)
    return x.reshape(rows, cols // g, g)


def signed_max(scheme: Scheme) -> bool:
    """Whether symmetric ``scheme`` maps the group's signed extreme onto ``qmin`` (its
    family's rule, :attr:`embedq.format.scheme_units.IntUnit.signed_max`)."""
    return scheme.symmetric and scheme.unit.signed_max


def quantize_rtn(x: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype):
    """Quantize ``x`` ([rows, cols], any float dtype) with the family's symmetric scales
    (absmax at 8 bits, signed-max at 4: ``scheme.unit.symmetric_scale``) or min-max
    (asymmetric) scales.

    Returns ``(q, scale, zero_point)``; ``zero_point`` is None when symmetric.
    """
    xg = _grouped(x.float(), scheme)
    unit = scheme.unit
    if scheme.symmetric:
        scale_q = round_scale_up(unit.symmetric_scale([xg]), scale_dtype)
        q = torch.round(xg / scale_q.float().unsqueeze(-1))
        q = q.clamp_(scheme.qmin, scheme.qmax).to(torch.int8)
        return q.reshape(x.shape), scale_q, None
    # The range always contains 0 so that the zero point is representable
    # (compressed-tensors does the same).
    scale, lo = unit.asymmetric_scale(*unit.group_range([xg]))
    scale_q = round_scale_up(scale, scale_dtype)
    sf = scale_q.float()
    zp = torch.round(scheme.qmin - lo / sf).clamp_(scheme.qmin, scheme.qmax)
    q = torch.round(xg / sf.unsqueeze(-1)) + zp.unsqueeze(-1)
    q = q.clamp_(scheme.qmin, scheme.qmax).to(torch.int8)
    return q.reshape(x.shape), scale_q, zp.to(torch.int8)
