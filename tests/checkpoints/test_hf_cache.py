"""The Hugging Face cache layout (models--org--name/snapshots/<rev>/ files symlinked into
blobs/): quantize in place, verify, remove and apply never write through a symlink into
a shared blob; derived output from a snapshot holds real files."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import embedq


def _as_hf_cache(src: Path, root: Path, rev: str = "a" * 40) -> tuple[Path, Path]:
    """``root/models--org--tiny`` built like huggingface_hub's cache from ``src``."""
    repo = root / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / rev
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    for f in sorted(src.iterdir()):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return blobs, snap


def _blobs(blobs: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(blobs.iterdir())}


def _no_embedq_in_blobs(blobs: Path) -> None:
    for p in blobs.iterdir():
        assert not p.is_symlink()
        assert p.name == hashlib.sha256(p.read_bytes()).hexdigest(), f"blob {p.name} was written"


def test_in_place_verify_remove_keep_blobs(model_factory, tmp_path):
    blobs, snap = _as_hf_cache(model_factory("qwen2_tied"), tmp_path)
    before = _blobs(blobs)
    embedq.quantize(snap, bits=8, progress=False)
    assert _blobs(blobs) == before
    _no_embedq_in_blobs(blobs)
    # what embedq changed is a real file in the snapshot; untouched files stay links
    assert not (snap / "config.json").is_symlink()
    assert (snap / "model.safetensors").is_symlink()
    assert (snap / "embedq.safetensors").is_file() and not (snap / "embedq.safetensors").is_symlink()
    embedq.verify(snap)
    assert _blobs(blobs) == before
    embedq.remove(snap)
    assert _blobs(blobs) == before
    assert not (snap / "embedq.safetensors").exists()


def test_sharded_in_place_and_derived(model_factory, tmp_path):
    blobs, snap = _as_hf_cache(model_factory("llama_untied_sharded"), tmp_path)
    before = _blobs(blobs)
    out = tmp_path / "derived"
    embedq.quantize(snap, bits=4, lm_head=True, output=out, progress=False)
    assert _blobs(blobs) == before
    for f in out.iterdir():
        assert not f.is_symlink(), f"{f.name} is a symlink in the derived checkpoint"
    embedq.verify(out)
    embedq.quantize(snap, bits=8, lm_head=True, progress=False)  # in place, index rewritten
    assert _blobs(blobs) == before
    assert not (snap / "model.safetensors.index.json").is_symlink()
    embedq.remove(snap)
    assert _blobs(blobs) == before


def test_apply_onto_snapshot(model_factory, tmp_path):
    src = model_factory("qwen2_tied")
    bundle = tmp_path / "bundle"
    embedq.quantize(src, bits=8, output=bundle, overlay_only=True, progress=False)
    blobs, snap = _as_hf_cache(src, tmp_path / "cache")
    before = _blobs(blobs)
    embedq.apply(snap, bundle)
    assert _blobs(blobs) == before
    embedq.verify(snap)
    embedq.remove(snap)
    assert _blobs(blobs) == before
    shutil.rmtree(snap.parent.parent.parent)
