"""Format 2 (BLAKE3 checksums) reads and verifies format-1 (sha256) overlays exactly.

tests/data/format1 was written by the format-1 code (commit 50ce402, see its
make_format1.py): an in-place int8 overlay on a tiny tied Qwen2, and an overlay-only
Q4 g32 asymmetric bundle of the same base.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

import embedq
from embedq.errors import OverlayError
from embedq.format.constants import FORMAT_VERSION
from embedq.format.digest import hexdigest

DATA = Path(__file__).resolve().parent / "data" / "format1"
TENSORS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def _inplace(tmp_path: Path) -> Path:
    """The stored format-1 in-place overlay, laid onto a copy of the base."""
    p = tmp_path / "inplace"
    shutil.copytree(DATA / "base", p)
    shutil.copytree(DATA / "inplace-int8", p, dirs_exist_ok=True)
    return p


def _qconfig(p: Path) -> dict:
    return json.loads((p / "quantization_config.json").read_text())


def _tensor_bytes(file: Path) -> dict[str, bytes]:
    with safe_open(str(file), framework="pt") as f:
        return {k: f.get_tensor(k).contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
                for k in f.keys()}


def test_format1_overlay_still_verifies(tmp_path):
    p = _inplace(tmp_path)
    cfg = _qconfig(p)
    assert cfg["format_version"] == 1 and "sha256" in cfg["modules"]["model.embed_tokens"]["source"]
    rep = embedq.verify(p)
    assert rep.modules[0].max_abs_error is not None and rep.modules[0].max_abs_error < 0.01


def test_format1_verify_stays_exact(tmp_path):
    p = _inplace(tmp_path)
    raw = bytearray((p / "embedq.safetensors").read_bytes())
    raw[-20] ^= 1  # one bit of the last tensor's data
    (p / "embedq.safetensors").write_bytes(bytes(raw))
    with pytest.raises(OverlayError, match="checksum"):
        embedq.verify(p)


def test_format1_changed_source_is_detected(tmp_path):
    from embedq.format.checkpoint import Checkpoint
    p = _inplace(tmp_path)
    info = Checkpoint.open(p).tensor("model.embed_tokens.weight")
    raw = bytearray((p / info.file).read_bytes())
    raw[info.file_offset + 1000] ^= 1
    (p / info.file).write_bytes(bytes(raw))
    with pytest.raises(OverlayError, match="changed since the overlay was made"):
        embedq.verify(p)


def test_format1_bundle_applies_and_verifies(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(DATA / "base", base)
    embedq.apply(base, DATA / "bundle-q4-g32-asym")
    assert _qconfig(base)["format_version"] == 1  # installed as made, not rewritten
    embedq.verify(base)


def test_format1_bundle_with_a_changed_tensor_is_not_applied(tmp_path):
    """apply checks each copied tensor against its recorded digest, sha256 in format 1: one
    flipped bit of the bundle's data is refused, the base unchanged (no backup, no overlay)."""
    base, bundle = tmp_path / "base", tmp_path / "bundle"
    shutil.copytree(DATA / "base", base)
    shutil.copytree(DATA / "bundle-q4-g32-asym", bundle)
    raw = bytearray((bundle / "embedq.safetensors").read_bytes())
    raw[-20] ^= 1  # one bit of the last tensor's data
    (bundle / "embedq.safetensors").write_bytes(bytes(raw))
    before = sorted(p.name for p in base.iterdir())
    with pytest.raises(OverlayError, match="does not match its recorded checksum"):
        embedq.apply(base, bundle)
    assert sorted(p.name for p in base.iterdir()) == before


def test_format1_bundle_refuses_another_base(tmp_path):
    from embedq.format.checkpoint import Checkpoint
    base = tmp_path / "base"
    shutil.copytree(DATA / "base", base)
    info = Checkpoint.open(base).tensor("model.embed_tokens.weight")
    raw = bytearray((base / info.file).read_bytes())
    raw[info.file_offset + 10] ^= 1
    (base / info.file).write_bytes(bytes(raw))
    with pytest.raises(OverlayError, match="sha256"):
        embedq.apply(base, DATA / "bundle-q4-g32-asym")


@pytest.mark.parametrize("stored,kwargs", [
    ("inplace-int8", dict(bits=8, group_size=0)),  # the stored overlay is per row
    ("bundle-q4-g32-asym", dict(bits=4, group_size=32, symmetric=False)),
])
def test_format2_writes_the_same_tensors_with_blake3(tmp_path, stored, kwargs):
    """Re-quantized now: every tensor byte equals format 1's; only the checksums' digest
    (and the version) changed, and both digests describe the same bytes."""
    base = tmp_path / "base"
    shutil.copytree(DATA / "base", base)
    kwargs = dict(kwargs)
    embedq.quantize(base, kwargs.pop("bits"), progress=False, **kwargs)
    old_file = DATA / stored / "embedq.safetensors"
    old, new = _tensor_bytes(old_file), _tensor_bytes(base / "embedq.safetensors")
    assert old == new
    oc, nc = _qconfig(DATA / stored), _qconfig(base)
    assert nc["format_version"] == FORMAT_VERSION == 2
    om, nm = oc["modules"]["model.embed_tokens"], nc["modules"]["model.embed_tokens"]
    for k, data in new.items():
        assert om["checksums"][k] == hashlib.sha256(data).hexdigest()
        assert nm["checksums"][k] == hexdigest(data, "blake3")
    assert set(nm["source"]) == {"tensor", "dtype", "blake3"}
    strip = lambda m: {k: v for k, v in m.items() if k not in ("checksums", "source")}  # noqa: E731
    assert strip(om) == strip(nm)
    assert {k: v for k, v in oc.items() if k not in ("modules", "format_version")} == \
        {k: v for k, v in nc.items() if k not in ("modules", "format_version")}
    embedq.verify(base)


def test_config_digest_must_match_its_version(tmp_path):
    from embedq.format.config import parse_config
    cfg = _qconfig(DATA / "inplace-int8")
    cfg["format_version"] = 2  # a format-2 config that records sha256
    with pytest.raises(OverlayError, match="sha256"):
        parse_config(cfg, "q.json")
    cfg["format_version"] = 3
    with pytest.raises(OverlayError, match="format_version"):
        parse_config(cfg, "q.json")
