"""``embedq onnx export`` / ``embedq onnx patch`` end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import embedq
from embedq.backends.onnx import export_model
from embedq.cli import app
from onnxutil import build_checkpoint, reference_logits, run_ort

runner = CliRunner()


def test_cli_export_in_place_overlay(model_factory, tmp_path):
    """In-place overlay (config.json carries the embedq quantization_config): export
    loads the float source shards and patches; one file, no external data."""
    ckpt = model_factory("qwen2_tied")
    embedq.quantize(ckpt, bits=4, progress=False)
    out = tmp_path / "out" / "model.onnx"
    res = runner.invoke(app, ["onnx", "export", str(ckpt), "-o", str(out), "--json",
                                 "--accuracy-level", "0"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output[res.output.index("{"):])
    assert [m["op"] for m in rep["modules"]] == ["GatherBlockQuantized", "MatMulNBits"]
    assert [m["source_check"] for m in rep["modules"]] == ["blake3", "blake3"]
    assert rep["external_data"] is False and sorted(p.name for p in out.parent.iterdir()) == ["model.onnx"]
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(run_ort(out, ids), reference_logits(ckpt, ckpt, ids), rtol=1e-5, atol=1e-5)
    # again without --force: refused, one line
    res = runner.invoke(app, ["onnx", "export", str(ckpt), "-o", str(out)])
    assert res.exit_code == 2 and "already exists" in res.output


def test_export_from_derived_checkpoint(float_model, tmp_path):
    """A derived checkpoint has no float table: the export fills it with the dequantized
    overlay, and the patch recognises it as such."""
    ckpt, _ = float_model("untied96")
    derived = tmp_path / "derived"
    embedq.quantize(ckpt, bits=8, lm_head=True, output=derived, progress=False)
    out = tmp_path / "m.onnx"
    r = export_model(derived, out, optimize=False, accuracy_level=0)
    assert [(m.op, m.source_check) for m in r.modules] == [
        ("GatherBlockQuantized", "dequantized"), ("MatMulNBits", "dequantized")]
    assert r.export_seconds > 0
    ids = torch.randint(0, 384, (2, 5), generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(run_ort(out, ids), reference_logits(ckpt, derived, ids),
                               rtol=1e-5, atol=1e-5)


def test_cli_patch_and_wrong_overlay(float_model, overlay_for, tmp_path):
    ckpt, fpath = float_model("tied96")
    ov = overlay_for("tied96", 8, 32)
    out = tmp_path / "q.onnx"
    res = runner.invoke(app, ["onnx", "patch", str(fpath), "--overlay", str(ov), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "GatherBlockQuantized" in res.output and "MatMulNBits" in res.output
    other = build_checkpoint("tied96", tmp_path / "other", seed=3)
    embedq.quantize(other, bits=8, group_size=32, progress=False)
    res = runner.invoke(app, ["onnx", "patch", str(fpath), "--overlay", str(other),
                              "-o", str(tmp_path / "bad.onnx")])
    assert res.exit_code == 2
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("embedq: error: ") and str(fpath) in lines[0]
    assert "is not the source of this overlay" in lines[0]
    assert not (tmp_path / "bad.onnx").exists()
    res = runner.invoke(app, ["onnx", "patch", str(fpath), "--overlay", str(tmp_path), "-o",
                              str(tmp_path / "x.onnx")])
    assert res.exit_code == 2 and "no embedq overlay" in res.output


@pytest.mark.parametrize("argv", [["onnx", "--help"], ["onnx", "patch", "--help"],
                                  ["onnx", "export", "--help"]])
def test_help(argv):
    res = runner.invoke(app, argv)
    assert res.exit_code == 0 and "Usage" in res.output


def test_export_without_onnxscript_says_so_first(model_factory, monkeypatch, tmp_path):
    """docs/onnx.md: without the onnx extra, one line naming it and exit 2. ``export`` needs
    onnxscript (torch.onnx's dynamo exporter) too: said before the slow load and export,
    not as a failed torch.onnx.export after them."""
    import sys
    ckpt = model_factory("qwen2_tied")
    embedq.quantize(ckpt, bits=4, progress=False)
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # import onnxscript -> ImportError
    out = tmp_path / "m.onnx"
    res = runner.invoke(app, ["onnx", "export", str(ckpt), "-o", str(out)])
    assert res.exit_code == 2, res.output
    assert "embedq: error: onnxscript not installed: pip install 'embedq[onnx]'" in res.output
    assert not out.exists() and not list(tmp_path.iterdir())
    # patch does not need onnxscript: its check names only onnx and onnxruntime
    from embedq.backends.onnx import require_onnx
    require_onnx()
