"""ggml's Q8_0 and Q4_0 blocks, written from embedq codes (no rounding: a re-layout).

Both are 32 elements with one float16 scale ``d`` stored first (ggml's ``block_q8_0`` /
``block_q4_0``, ggml-common.h):

- Q8_0, 34 bytes: ``d``, then the 32 codes as int8. Value ``x[j] = d * q[j]``: embedq's
  symmetric int8 code and scale, unchanged.
- Q4_0, 18 bytes: ``d``, then 16 bytes where **byte j = u[j] | u[j+16] << 4** with
  ``u = q + 8`` (the block's first half in the low nibbles, its second half in the high
  ones; not embedq's even/odd packing). Value ``x[j] = d * (u[j] - 8)``: embedq's
  symmetric 4-bit code and scale.

A group of ``k * 32`` columns becomes ``k`` blocks repeating its scale (exact).
"""

from __future__ import annotations

import numpy as np
import torch

QK = 32  # elements per block (QK8_0 == QK4_0)
Q8_0, Q4_0 = 8, 2  # GGMLQuantizationType values
BLOCK_BYTES = {Q8_0: 2 + QK, Q4_0: 2 + QK // 2}
BITS_TYPE = {8: Q8_0, 4: Q4_0}


def block_scales(scale: torch.Tensor, cols: int) -> torch.Tensor:
    """float16 scales [rows, groups] to one per 32-block [rows, cols/32] (groups of k*32
    columns repeat theirs)."""
    per = cols // QK // scale.shape[1]
    return scale if per == 1 else scale.repeat_interleave(per, dim=1)


def encode(codes: torch.Tensor, scale: torch.Tensor, ggml_type: int) -> np.ndarray:
    """Signed codes int8 [rows, cols] and float16 scales [rows, groups] to the rows' GGUF
    bytes, uint8 [rows, cols/32 * block bytes]."""
    rows, cols = codes.shape
    nb = cols // QK
    d = block_scales(scale, cols).contiguous().view(torch.uint8).reshape(rows, nb, 2)
    q = codes.reshape(rows, nb, QK)
    if ggml_type == Q8_0:
        body = q.view(torch.uint8)
    elif ggml_type == Q4_0:
        u = (q + 8).view(torch.uint8)
        body = u[..., : QK // 2] | (u[..., QK // 2:] << 4)
    else:
        raise ValueError(f"no block encoder for ggml type {ggml_type}")
    return torch.cat((d, body), dim=-1).reshape(rows, -1).numpy()

