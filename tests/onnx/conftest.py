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


# ------------------------------------------------------------------ Gemma 3 270M (slow tests)

@pytest.fixture(scope="session")
def gemma3_q4_export(gemma3_270m, tmp_path_factory):
    """Gemma 3 270M quantized in place at 4 bits (g32 sym) and exported once with the real
    verb, ``export_model`` (optimize=False, accuracy_level=0): a dict with ``ckpt``, ``out``
    (the patched graph), ``report``, ``seconds`` (quantize + export) and ``float`` (the
    float graph the export patched, kept from its staging folder).

    The float export of Gemma (torch.onnx, dynamo) costs ~45 s on 2 cores and its graph does
    not depend on the overlay: test_onnx_real_gemma3 checks the export itself, and
    test_webgpu_real patches the same float graph with its split instead of exporting again.
    """
    import time

    import embedq
    import embedq.backends.onnx.export as export_mod
    from embedq.format.files import link_checkpoint
    root = tmp_path_factory.mktemp("gemma3-onnx")
    ckpt = link_checkpoint(gemma3_270m, root / "gemma3-270m")  # shards hard-linked: read-only use
    keep = root / "float"
    real_patch = export_mod.patch_model

    def keep_float(fpath, *args, **kwargs):
        # export_model's staging folder goes when it returns: hard links keep its float
        # graph (the model and its external data) without copying ~1 GB
        keep.mkdir()
        for f in Path(fpath).parent.iterdir():
            if f.is_file():
                os.link(f, keep / f.name)
        return real_patch(fpath, *args, **kwargs)

    t0 = time.perf_counter()
    embedq.quantize(ckpt, bits=4, progress=False)  # in place: g32 symmetric
    out = root / "gemma3-270m-q4.onnx"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export_mod, "patch_model", keep_float)
        # optimize=False: onnxscript's optimizer roughly doubles the export time here
        report = export_mod.export_model(ckpt, out, optimize=False, accuracy_level=0)  # float activations
    float_onnx = keep / "float.onnx"
    assert float_onnx.is_file(), sorted(p.name for p in keep.iterdir())
    return {"ckpt": ckpt, "out": out, "report": report, "float": float_onnx,
            "seconds": time.perf_counter() - t0}
