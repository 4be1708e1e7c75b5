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


def _retie(path, *, tied: bool, head=None) -> None:
    """Edit a one-file checkpoint in place: ``tie_word_embeddings`` set to ``tied``, and
    ``lm_head.weight`` replaced by ``head`` (None: removed). The embedding is left bit for bit."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    tensors.pop("lm_head.weight", None)
    if head is not None:
        tensors["lm_head.weight"] = head
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = tied
    (path / "config.json").write_text(json.dumps(cfg))


def test_apply_refuses_tied_bundle_on_untied_base(model_factory, derive):
    """A bundle from a tied model aliases the head to the embedding: laid onto an untied
    base with the same embedding, the base's own head would be served from it."""
    from safetensors.torch import load_file
    src, bundle, _ = derive("qwen2_tied", bits=4, overlay_only=True)
    base = model_factory("qwen2_tied")
    emb = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    _retie(base, tied=False, head=(emb.float() * 0.5 + 0.01).to(emb.dtype))
    before = snapshot(base)
    r = CliRunner().invoke(app, ["apply", str(base), "--overlay", str(bundle)])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"embedq: error: {bundle / 'quantization_config.json'}: the bundle ties the head "
                           f"to the embedding"), line
    assert f"the base {base} is untied and has its own head lm_head.weight" in line
    assert f"embedq quantize {base}" in line
    assert snapshot(base) == before and not (base / ".embedq").exists()
    # the same bundle still fits its own (tied) source
    embedq.apply(src, bundle)
    embedq.verify(src)


@pytest.mark.parametrize("lm_head", [False, True])
def test_apply_refuses_untied_bundle_on_tied_base(model_factory, derive, lm_head):
    """The reverse: a bundle from an untied model (its head float, or quantized from its own
    head tensor) laid onto a tied base with the same embedding is refused, never untying it."""
    _, bundle, _ = derive("llama_untied_fp32", overlay_only=True, lm_head=lm_head)
    base = model_factory("llama_untied_fp32")
    _retie(base, tied=True)
    before = snapshot(base)
    r = CliRunner().invoke(app, ["apply", str(base), "--overlay", str(bundle)])
    assert r.exit_code == 2, r.output
    line = r.output.strip()
    assert "\n" not in line and "Traceback" not in line
    if lm_head:  # the head module's source tensor is not in the base at all
        assert f"{base}: has no tensor lm_head.weight, which the overlay replaces" in line, line
    else:
        assert f"{bundle / 'quantization_config.json'}: the bundle was made from an untied model" in line, line
        assert f"the base {base} ties its head to the embedding" in line and f"embedq quantize {base}" in line
    assert snapshot(base) == before and not (base / ".embedq").exists()


def test_apply_refuses_a_tie_mismatch_before_hashing(model_factory, derive, monkeypatch):
    """A tie mismatch that config.json and the tensor names decide is refused before any
    source table is hashed (minutes on a big base); a base that fits is still hashed."""
    import embedq.jobs.apply as apply_mod
    from safetensors.torch import load_file
    src, tied, _ = derive("qwen2_tied", bits=4, overlay_only=True)
    _, untied, _ = derive("llama_untied_fp32", name="untied", overlay_only=True)
    untied_base, tied_base = model_factory("qwen2_tied"), model_factory("llama_untied_fp32")
    emb = load_file(untied_base / "model.safetensors")["model.embed_tokens.weight"]
    _retie(untied_base, tied=False, head=(emb.float() * 0.5 + 0.01).to(emb.dtype))
    _retie(tied_base, tied=True)
    hashed: list = []
    real = apply_mod._digest_range
    monkeypatch.setattr(apply_mod, "_digest_range", lambda path, *a: hashed.append(path) or real(path, *a))
    with pytest.raises(OverlayError, match="the bundle ties the head to the embedding"):
        embedq.apply(untied_base, tied)
    with pytest.raises(OverlayError, match="ties its head to the embedding"):
        embedq.apply(tied_base, untied)
    assert hashed == []
    embedq.apply(src, tied)  # a base that fits: its source table is hashed
    assert hashed == [src / "model.safetensors"]


def test_apply_ambiguous_base_takes_the_bundles_choice(model_factory, derive):
    """A base whose config says tied but whose head differs (quantize needs --trust-config or
    --trust-tensors): the bundle made from it with one of them records that choice."""
    from safetensors.torch import load_file
    src = model_factory("qwen2_tied")
    emb = load_file(src / "model.safetensors")["model.embed_tokens.weight"]
    _retie(src, tied=True, head=(emb.float() * 0.5).to(emb.dtype))
    _, bundle, report = derive("qwen2_tied", source=src, overlay_only=True, trust="config")
    assert report.tied
    embedq.apply(src, bundle)
    embedq.verify(src)


def test_apply_tie_check_reads_no_table_it_does_not_need(model_factory, derive, monkeypatch):
    """A tied base that also stores its head (a copy of the embedding): a tied bundle fits
    it whether or not the copy is identical (identical: tied; different: the bundle's choice),
    so apply never compares the two tables (a full read of both when they are equal). An
    untied bundle still needs the comparison, and is refused when the copy is identical."""
    from safetensors.torch import load_file
    src = model_factory("qwen2_tied")
    emb = load_file(src / "model.safetensors")["model.embed_tokens.weight"]
    _retie(src, tied=True, head=emb.clone())
    _, bundle, report = derive("qwen2_tied", source=src, overlay_only=True)
    assert report.tied
    calls: list = []
    real = Checkpoint.tensors_identical
    monkeypatch.setattr(Checkpoint, "tensors_identical",
                        lambda self, a, b: calls.append((a, b)) or real(self, a, b))
    embedq.apply(src, bundle)
    embedq.verify(src)
    assert calls == []
    # the reverse still compares, and refuses
    _, untied, _ = derive("llama_untied_fp32", name="untied", overlay_only=True)
    base = model_factory("llama_untied_fp32")
    emb = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    _retie(base, tied=True, head=emb.clone())
    calls.clear()  # (quantize compares them too)
    with pytest.raises(OverlayError, match="ties its head to the embedding"):
        embedq.apply(base, untied)
    assert calls == [("model.embed_tokens.weight", "lm_head.weight")]


def test_apply_over_a_stale_backup_backs_up_the_current_files_and_warns(model_factory, derive):
    """security.md 6: a backup that no longer matches the disk (the model was updated after
    an in-place run) is never restored: ``apply`` backs up the current files instead, says
    so, and ``remove`` then restores those, byte for byte."""
    _, bundle, _ = derive("llama_untied_sharded", overlay_only=True)
    base = model_factory("llama_untied_sharded")
    index = (base / "model.safetensors.index.json").read_bytes()
    embedq.quantize(base, 8, progress=False)
    stale = snapshot(base / ".embedq")
    cfg = json.loads((base / ".embedq" / "config.json").read_text())  # the model is updated
    cfg["rope_theta"] = 12345.0  # (re-downloaded): a newer config.json, no overlay files
    (base / "config.json").write_text(json.dumps(cfg, indent=1))
    (base / "model.safetensors.index.json").write_bytes(index)
    for n in ("embedq.safetensors", "quantization_config.json"):
        (base / n).unlink()
    newer = {n: (base / n).read_bytes() for n in ("config.json", "model.safetensors.index.json")}
    r = CliRunner().invoke(app, ["apply", str(base), "--overlay", str(bundle)])
    assert r.exit_code == 0, r.output
    assert (f"warning: {base / '.embedq'}: ignored a stale backup (config.json was changed after embedq "
            "backed it up); the current config.json is what `embedq remove` will restore") in r.output, r.output
    assert snapshot(base / ".embedq") != stale
    for n, data in newer.items():  # the current files backed up, the stale backup gone
        assert (base / ".embedq" / n).read_bytes() == data, n
    embedq.verify(base)
    embedq.remove(base)
    for n, data in newer.items():
        assert (base / n).read_bytes() == data, n
    assert not (base / ".embedq").exists()
