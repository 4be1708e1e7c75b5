"""Is an overlay a quantization of the table a GGUF holds? The bound, derived.

Per element, with ``G`` the GGUF's table decoded, ``W`` the float table the overlay was
made from and ``O`` the overlay decoded: ``|G - O| <= |G - W| + |W - O|``, and

- ``|G - W| <= eps_type + eps_store``: ``eps_type`` is the GGUF type's rounding of ``W``
  (a GGUF converted from the checkpoint): Q8_0 ``d = amax/127``, ``q = round(x/d)``, ``d``
  stored as float16: ``|d|/2 + 127 |d| 2^-11``; Q4_0 ``d = m/-8``, the top code clamped
  at 7: ``|d| + 8 |d| 2^-11``; float types half an ulp; other block types a full step of
  their nominal bits over the 32-element block's extreme (loose, never tight).
  ``eps_store`` is ``W``'s own rounding to its dtype (a checkpoint made from the GGUF, as
  this project's Gemma fixture): ``|G| 2^-8`` for bfloat16.
- ``|W - O| <= eps_overlay`` for ``rtn``: ``|s|/2`` for 8-bit (``s >= amax/127``, rounded
  up: no code clamps), ``|s|`` for 4-bit (``s = m/-8``: the top code clamps at 7).

``rtn`` tables must meet the bound at every element. ``gptq``/``mse`` tables trade
element error for output error, so no per-element bound holds: each *row* must stay
within the bound in RMS (an overlay farther from ``G`` than RTN's worst case at every
element is not a quantization of it). A table of another model misses by far: on Gemma
3 270M with its rows shifted by one, the median row is 3.5x (4-bit) to 50x (8-bit) the
bound.
"""

from __future__ import annotations

import numpy as np
import torch

from embedq.backends.gguf.blocks import Q4_0, Q8_0, QK
from embedq.errors import OverlayError

# nominal bits of the other block types (a step of amax / 2^(bits-1) bounds their error;
# a type not named here gets 1 bit: a vacuous bound, never a false refusal)
_NOMINAL_BITS = {"Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_1": 8, "Q2_K": 2, "Q3_K": 3, "Q4_K": 4,
                 "Q5_K": 5, "Q6_K": 6, "Q8_K": 8, "IQ4_NL": 4, "IQ4_XS": 4, "IQ3_S": 3,
                 "IQ3_XXS": 3, "IQ2_XXS": 2, "IQ2_XS": 2, "IQ2_S": 2, "TQ2_0": 2}
_STORE = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}
_SLACK = 1 + 2.0 ** -10  # float32 arithmetic of the encoders and of this check


def gguf_rounding(raw: np.ndarray, decoded: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Per-element bound on ``|decoded - W|`` for the float ``W`` the type rounded."""
    from gguf.constants import GGMLQuantizationType as T
    rows, cols = decoded.shape
    if ggml_type in (Q8_0, Q4_0):
        nb = cols // QK
        width = raw.shape[1] // nb
        d = raw.reshape(rows, nb, width)[:, :, :2].copy().view(np.float16).astype(np.float32)
        d = torch.from_numpy(d).abs().reshape(rows, nb)
        k = 0.5 + 127 * 2.0 ** -11 if ggml_type == Q8_0 else 1 + 8 * 2.0 ** -11
        return (d * k).repeat_interleave(QK, dim=1)
    if ggml_type == T.F32:
        return decoded.abs() * 2.0 ** -24
    if ggml_type == T.F16:
        return decoded.abs() * 2.0 ** -11 + 2.0 ** -25
    if ggml_type == T.BF16:
        return decoded.abs() * 2.0 ** -8
    bits = _NOMINAL_BITS.get(T(ggml_type).name, 1)
    amax = decoded.abs().reshape(rows, cols // QK, QK).amax(dim=-1)
    return (amax * 2.0 ** -(bits - 1)).repeat_interleave(QK, dim=1)


def overlay_rounding(scale: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Per-element bound on ``|W - O|`` of an RTN table with these scales."""
    s = scale.float().abs() * (0.5 if bits == 8 else 1.0)
    return s.repeat_interleave(cols // scale.shape[1], dim=1)


def check_rows(where: str, tensor: str, g: torch.Tensor, eps_g: torch.Tensor, o: torch.Tensor,
               scale: torch.Tensor, bits: int, method: str, source_dtype: str | None,
               row0: int) -> float:
    """Refuse rows ``row0...`` of an overlay table that the GGUF's table rules out; the
    worst ratio of distance to bound (<= 1 passes)."""
    bound = (eps_g + g.abs() * _STORE.get(source_dtype or "bfloat16", 2.0 ** -8)
             + overlay_rounding(scale, bits, g.shape[1])) * _SLACK
    e = (g - o).abs()
    if method == "rtn":
        ratio = e / bound.clamp_min(torch.finfo(torch.float32).tiny)
        ratio = torch.where(e == 0, torch.zeros_like(ratio), ratio).amax(dim=1)
    else:
        ratio = e.pow(2).mean(dim=1).sqrt() / bound.pow(2).mean(dim=1).sqrt().clamp_min(
            torch.finfo(torch.float32).tiny)
    worst = int(ratio.argmax())
    r = float(ratio[worst])
    if r > 1:
        how = "an element" if method == "rtn" else "in RMS"
        raise OverlayError(
            f"{where}: not a quantization of the GGUF's {tensor}: row {row0 + worst} differs "
            f"{how} by {r:.3g}x what the GGUF type's and the overlay's rounding allow "
            "(an overlay of another model?)")
    return r
