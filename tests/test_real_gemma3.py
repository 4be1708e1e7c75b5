"""Real-model check: Gemma 3 270M (tied, 262,144 x 640 bf16)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import embedq
from ckptutil import snapshot
from embedq.format.reader import load_overlay

pytestmark = pytest.mark.slow


# (bits, --group-size, scales per row): the two defaults (g64, g32) and int8 per row, the
# README's size table (printed with -s)
@pytest.mark.parametrize("bits,group,scales", [(8, None, 10), (8, 0, 1), (4, None, 20)])
def test_gemma3_270m_tied_table(gemma3_copy, bits, group, scales):
    path = gemma3_copy
    before = snapshot(path)
    rep = embedq.quantize(path, bits=bits, group_size=group, progress=False)
    m = rep.modules[0]
    assert rep.tied and m.module == "model.embed_tokens" and m.aliases == ["lm_head"]
    assert m.shape == [262144, 640]
    assert m.bytes_before == 262144 * 640 * 2
    expected = 262144 * 640 * bits // 8 + 262144 * scales * 2 + 16
    assert m.bytes_after == expected == (path / "embedq.safetensors").stat().st_size - _header(path)
    print(f"\nGemma 3 270M {m.scheme}: {m.bytes_before / 1e6:.1f} MB -> {m.bytes_after / 1e6:.1f} MB, "
          f"saved {rep.bytes_saved / 1e6:.1f} MB, max err {m.max_abs_error:.3g}")
    # spot-check rows against the float table
    t = load_overlay(path).tables["model.embed_tokens"]
    rows = torch.tensor([0, 2, 1000, 262143])
    with safe_open(path / "model.safetensors", "pt") as f:
        x = f.get_slice("model.embed_tokens.weight")
        ref = torch.stack([x[int(r):int(r) + 1][0] for r in rows]).float()
    step = t.scale[rows].float().abs().repeat_interleave(640 // t.scale.shape[1], dim=1)
    factor = 0.5 if bits == 8 else 1.0  # 4-bit signed-max: the other sign's extreme may clip to 7
    assert bool(((t.dequantize(torch.float32, rows) - ref).abs() <= step * factor * (1 + 1e-5)).all())
    embedq.verify(path)
    embedq.remove(path)
    assert snapshot(path) == before


def _header(path):
    with open(path / "embedq.safetensors", "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")
