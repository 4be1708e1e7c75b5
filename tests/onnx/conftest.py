"""Fixtures for the ONNX back end: tiny checkpoints (hidden 96: odd blocks at g32) and
their float ONNX exports, built once per session; overlays per scheme; references."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import onnx  # noqa: F401  (the [test] extra installs onnx, onnxruntime, onnxscript)
import onnxruntime  # noqa: F401
import onnxscript  # noqa: F401

import clients

from onnxutil import VOCAB, build_checkpoint, save_tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]


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


# ------------------------------------------- exporters' graphs (test_exporters, transformers.js)

def _setup(script: str) -> str:
    return clients.setup(f"scripts/{script}", script.removeprefix("setup_").removesuffix(".sh"))


@pytest.fixture(scope="session")
def genai_site() -> Path:
    site = Path(_setup("setup_genai_onnx.sh"))
    if str(site) not in sys.path:
        sys.path.append(str(site))  # after the venv: only onnxruntime_genai comes from here
    return site


@pytest.fixture(scope="session")
def optimum_python() -> str:
    return _setup("setup_optimum_onnx_venv.sh")


@pytest.fixture(scope="session")
def checkpoints(onnx_root):
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            cache[kind] = build_checkpoint(kind, onnx_root / f"exp-{kind}")
            save_tiny_tokenizer(cache[kind], VOCAB[kind])
        return cache[kind]
    return get


@pytest.fixture(scope="session")
def builder_folder(genai_site, checkpoints, onnx_root):
    """``builder_folder(kind)`` -> onnxruntime-genai fp32 CPU folder (builder defaults)."""
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            out = onnx_root / f"builder-{kind}"
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(genai_site), str(REPO)]))
            p = subprocess.run([sys.executable, str(REPO / "scripts" / "genai_build.py"), "-i",
                                str(checkpoints(kind)), "-o", str(out), "-p", "fp32", "-e", "cpu",
                                "-c", str(onnx_root / "builder-cache")],
                               capture_output=True, text=True, env=env)
            assert p.returncode == 0, p.stderr[-3000:]
            cache[kind] = out
        return cache[kind]
    return get


@pytest.fixture(scope="session")
def optimum_model(optimum_python, checkpoints, onnx_root):
    """``optimum_model(kind)`` -> model.onnx of optimum's text-generation-with-past export."""
    cache: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in cache:
            out = onnx_root / f"optimum-{kind}"
            cli = Path(optimum_python).parent / "optimum-cli"
            p = subprocess.run([str(cli), "export", "onnx", "--model", str(checkpoints(kind)),
                                "--task", "text-generation-with-past", str(out)],
                               capture_output=True, text=True)
            assert p.returncode == 0, p.stderr[-3000:]
            cache[kind] = out / "model.onnx"
        return cache[kind]
    return get


@pytest.fixture(scope="session")
def overlay(checkpoints, onnx_root):
    import embedq
    cache: dict[tuple, Path] = {}

    def get(kind: str, bits: int, group: int | None) -> Path:
        key = (kind, bits, group)
        if key not in cache:
            dst = onnx_root / "exp-overlays" / "-".join(map(str, key))
            embedq.quantize(checkpoints(kind), bits=bits, group_size=0 if group is None else group,
                            lm_head=kind.startswith("untied"), output=dst, overlay_only=True,
                            progress=False)
            cache[key] = dst
        return cache[key]
    return get
