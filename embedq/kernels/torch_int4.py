"""torch's CPU int4 layout (``_convert_weight_to_int4pack_for_cpu``), discovered rather
than hard-coded: the fallback 4-bit route of the dispatch table (``int4_cpu``) and its
row decoder. It depends on the CPU capability (AVX512: 64-row blocks, lanes interleaved;
AVX2: 32; scalar: pairs). The op's code comments describe the structure relied on: rows in
blocks of B, each block a [K, B/2] byte matrix whose k-th byte row holds the B nibbles of
column k in a fixed per-block order. Probed on a small table, verified on a random one.
"""

from __future__ import annotations

import torch


_LAYOUT: tuple[int, torch.Tensor] | None | bool = False  # False: not probed yet


def int4_nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> nibble values [..., 2n] in position order (low nibble first)."""
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(*b.shape[:-1], -1)


def int4_layout() -> tuple[int, torch.Tensor] | None:
    """(block rows B, position of each block row) of the CPU int4 layout, or None."""
    global _LAYOUT
    if _LAYOUT is not False:
        return _LAYOUT
    layout = None
    try:
        conv = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        n = 128
        d = torch.arange(n)
        probe = torch.stack([d & 15, (d >> 4) & 15], dim=1).to(torch.int32)  # K = 2: row id in 2 nibbles
        nib = int4_nibbles(conv(probe, 1).reshape(-1)).to(torch.int64)
        for B in (64, 32, 16):
            blocks = nib.view(n // B, 2, B)
            local = blocks[:, 0] + 16 * blocks[:, 1] - torch.arange(n // B).unsqueeze(1) * B
            if not (local == local[0]).all() or not torch.equal(local[0].sort().values, torch.arange(B)):
                continue
            pos = torch.argsort(local[0])  # pos[d] = nibble position of block row d
            g = torch.Generator().manual_seed(0)
            w = torch.randint(0, 16, (2 * B, 96), generator=g, dtype=torch.int32)
            if torch.equal(int4_decode(conv(w, 1), B, pos, torch.arange(2 * B), 96).to(torch.int32), w):
                layout = (B, pos)
                break
    except (RuntimeError, AttributeError):  # op missing or refused: no int4 fast path
        layout = None
    _LAYOUT = layout
    return layout


def int4_decode(w4: torch.Tensor, B: int, pos: torch.Tensor, ids: torch.Tensor, K: int) -> torch.Tensor:
    """Unsigned codes (uint8 [n, K]) of rows ``ids`` from a CPU int4-layout table."""
    flat = w4.reshape(-1)
    pos = pos.to(ids.device)
    p = pos[ids % B]
    base = (ids // B) * (B * K // 2) + p // 2
    idx = base.unsqueeze(1) + torch.arange(K, device=ids.device) * (B // 2)
    shift = ((p % 2) * 4).to(torch.uint8).unsqueeze(1)
    return (flat[idx] >> shift) & 15



__all__ = ["int4_decode", "int4_layout", "int4_nibbles"]
