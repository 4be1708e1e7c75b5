"""``embedq apply``: an overlay-only bundle laid onto a local copy of its base."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

import embedq
from embedq.cli import app
from embedq.errors import OverlayError
from embedq.format.checkpoint import Checkpoint

from pubutil import derive, snapshot  # noqa: F401 (fixture)


@pytest.mark.parametrize("kind,kw", [
    ("qwen2_tied", dict(bits=4)),
    ("llama_untied_sharded", dict(bits=8, lm_head=True, head_bits=8)),
    ("gemma3_tied", dict(bits=4, symmetric=False, head_bits=8)),
])
def test_apply_equals_in_place_and_removes_cleanly(model_factory, derive, kind, kw):
    src, bundle, _ = derive(kind, overlay_only=True, **kw)
    base = model_factory(kind)
    pristine = snapshot(base)
    report = embedq.apply(base, bundle)
    assert report.mode == "apply"
    # Same result as quantizing that base in place.
    ref = model_factory(kind)
    embedq.quantize(ref, kw.pop("bits"), progress=False, **kw)
    for name in ("config.json", "quantization_config.json", "model.safetensors.index.json"):
        if (ref / name).exists():
            assert json.loads((base / name).read_text()) == json.loads((ref / name).read_text()), name
    ov_a, ov_b = embedq.load_overlay(base), embedq.load_overlay(ref)
    for m, t in ov_b.tables.items():
        assert (ov_a.tables[m].packed == t.packed).all() and (ov_a.tables[m].scale == t.scale).all()
    embedq.verify(base)  # checksums against the base's own tables
    assert (base / ".embedq").is_dir()
    embedq.remove(base)
    assert snapshot(base) == pristine


def test_apply_refuses_a_different_base(model_factory, derive):
    _, bundle, _ = derive("llama_untied_sharded", overlay_only=True)
    base = model_factory("llama_untied_sharded")
    ck = Checkpoint.open(base)
    info = ck.tensor("model.embed_tokens.weight")
    with open(base / info.file, "r+b") as f:  # one changed value in the embedding table
        f.seek(info.file_offset + 1000)
        b = f.read(1)
        f.seek(info.file_offset + 1000)
        f.write(bytes([b[0] ^ 0x01]))
    before = snapshot(base)
    r = CliRunner().invoke(app, ["apply", str(base), "--overlay", str(bundle)])
    assert r.exit_code == 2
    line = r.output.strip()
    assert "\n" not in line
    assert f"{base / info.file}: model.embed_tokens.weight blake3" in line and "refusing" in line
    assert snapshot(base) == before  # nothing written, no backup, no temp files


def test_apply_refuses_another_model(model_factory, derive):
    _, bundle, _ = derive("qwen2_tied", overlay_only=True)
    base = model_factory("llama_untied_fp32")
    before = snapshot(base)
    with pytest.raises(OverlayError, match=r"has shape \[300, 64\], the overlay was made from \[512, 64\]"):
        embedq.apply(base, bundle)
    assert snapshot(base) == before


def test_apply_refuses_corrupt_bundle(model_factory, derive):
    _, bundle, _ = derive("qwen2_tied", overlay_only=True)
    f = bundle / "embedq.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    base = model_factory("qwen2_tied")
    before = snapshot(base)
    with pytest.raises(OverlayError, match="does not match its recorded checksum"):
        embedq.apply(base, bundle)
    assert snapshot(base) == before


@pytest.mark.parametrize("drop", ["one", "all"])
def test_apply_refuses_bundle_without_a_checksum(model_factory, derive, drop):
    _, bundle, _ = derive("llama_untied_sharded", overlay_only=True, lm_head=True)
    qfile = bundle / "quantization_config.json"
    qc = json.loads(qfile.read_text())
    sums = qc["modules"]["lm_head"]["checksums"]
    if drop == "all":
        sums.clear()
    else:
        del sums["lm_head.weight_scale"]
    qfile.write_text(json.dumps(qc))
    base = model_factory("llama_untied_sharded")
    before = snapshot(base)
    r = CliRunner().invoke(app, ["apply", str(base), "--overlay", str(bundle)])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and "Traceback" not in line
    assert f"{qfile}: module lm_head: no checksum recorded for lm_head.weight_" in line
    assert "--overlay-only" in line
    assert snapshot(base) == before and not (base / ".embedq").exists()


def test_apply_existing_overlay_needs_force(model_factory, derive):
    _, bundle, _ = derive("qwen2_tied", bits=4, overlay_only=True)
    base = model_factory("qwen2_tied")
    pristine = snapshot(base)
    embedq.quantize(base, 8, progress=False)
    with pytest.raises(OverlayError, match="--force"):
        embedq.apply(base, bundle)
    embedq.apply(base, bundle, force=True)
    qc = json.loads((base / "quantization_config.json").read_text())
    assert qc["modules"]["model.embed_tokens"]["num_bits"] == 4
    embedq.verify(base)
    embedq.remove(base)
    assert snapshot(base) == pristine


def test_apply_cli_and_missing_bundle(model_factory, derive, tmp_path):
    _, bundle, _ = derive("qwen2_tied", overlay_only=True)
    base = model_factory("qwen2_tied")
    r = CliRunner().invoke(app, ["apply", str(base), "--overlay", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "no such overlay folder" in r.output
    r = CliRunner().invoke(app, ["apply", str(base), "--overlay", str(bundle)])
    assert r.exit_code == 0, r.output
    assert f"embedq remove {base}" in r.output
    assert not [p for p in os.listdir(base) if p.endswith(".partial")]
