"""Fixtures for the ONNX back end: tiny checkpoints (hidden 96: odd blocks at g32) and
their float ONNX exports, built once per session; overlays per scheme; references."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from onnxutil import build_checkpoint


@pytest.fixture(scope="session")
def onnx_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("onnx")


@pytest.fixture(scope="session")
def float_model(onnx_root):
    """``float_model(kind)`` -> (checkpoint dir, float ONNX path), exported once."""
    from embedq.backends.onnx import export_float, load_float_model
    cache: dict[str, tuple[Path, Path]] = {}

    def get(kind: str) -> tuple[Path, Path]:
        if kind not in cache:
            ckpt = build_checkpoint(kind, onnx_root / kind)
            fpath = onnx_root / f"{kind}-float" / "model.onnx"
            fpath.parent.mkdir()
            export_float(load_float_model(ckpt), fpath)
            cache[kind] = (ckpt, fpath)
        return cache[kind]

    return get


@pytest.fixture(scope="session")
def overlay_for(onnx_root, float_model):
    """``overlay_for(kind, bits, group, symmetric, lm_head)`` -> overlay-only bundle dir."""
    import embedq
    cache: dict[tuple, Path] = {}

    def get(kind: str, bits: int, group: int | None, symmetric: bool = True,
            lm_head: bool = False) -> Path:
        key = (kind, bits, group, symmetric, lm_head)
        if key not in cache:
            ckpt, _ = float_model(kind)
            dst = onnx_root / "overlays" / "-".join(map(str, key))
            embedq.quantize(ckpt, bits=bits, group_size=0 if group is None else group,
                            symmetric=symmetric, lm_head=lm_head, output=dst,
                            overlay_only=True, progress=False)
            cache[key] = dst
        return cache[key]

    return get


