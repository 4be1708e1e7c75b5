"""Patched graphs in onnxruntime (CPU) against PyTorch with the dequantized tables."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from embedq.backends.onnx import OnnxError, patch_model, read_metadata

from onnxutil import build_checkpoint, initializer_bytes, reference_logits, run_ort

# (bits, group, symmetric): per-row int8 is 3 blocks of 32 on hidden 96; g32 is 3 blocks.
SCHEMES = [(8, None, True), (8, 32, True), (4, 32, True), (4, 32, False), (8, None, False)]


def expected_table_bytes(V: int, H: int, bits: int, group: int | None) -> int:
    block = 32  # hidden 96: largest power of two dividing 96 (per row) and g32
    nb = H // block
    return V * H * bits // 8 + V * nb * 4 + V * -(-nb * bits // 8)


def _ids(vocab: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 13), generator=g)


@pytest.mark.parametrize("kind,lm_head", [("tied96", False), ("untied96", True)])
@pytest.mark.parametrize("bits,group,sym", SCHEMES, ids=lambda v: str(v))
def test_patched_logits_equal_dequantized_pytorch(float_model, overlay_for, tmp_path,
                                                  kind, lm_head, bits, group, sym):
    ckpt, fpath = float_model(kind)
    ov = overlay_for(kind, bits, group, sym, lm_head)
    out = tmp_path / "q.onnx"
    report = patch_model(fpath, ov, out, accuracy_level=0)  # exact: float activations
    cfg = json.loads((ov / "quantization_config.json").read_text())
    V, H = cfg["modules"]["model.embed_tokens"]["shape"]

    # the graph: one GatherBlockQuantized and one MatMulNBits, no float Gather left
    mp = onnx.load(str(out), load_external_data=False)
    ops = [n.op_type for n in mp.graph.node]
    assert ops.count("GatherBlockQuantized") == 1 and ops.count("MatMulNBits") == 1
    assert "Gather" not in ops
    gbq = next(n for n in mp.graph.node if n.op_type == "GatherBlockQuantized")
    mm = next(n for n in mp.graph.node if n.op_type == "MatMulNBits")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gbq.attribute}
    assert attrs == {"bits": bits, "block_size": 32, "gather_axis": 0, "quantize_axis": 1}
    assert len(gbq.input) == 4 and len(mm.input) == 4  # zero points always emitted
    producer = {o: n for n in mp.graph.node for o in n.output}
    if kind == "tied96":
        # one shared uint8 initializer: MatMulNBits reads it through a Reshape
        reshape = producer[mm.input[1]]
        assert reshape.op_type == "Reshape" and reshape.input[0] == gbq.input[0]
        assert mm.input[2] == gbq.input[2] and mm.input[3] == gbq.input[3]
        assert [m.source_check for m in report.modules] == ["blake3", "blake3"]
    else:
        assert producer[mm.input[1]].input[0] != gbq.input[0]

    # bytes: exactly the float tables out, the quantized tables in
    before, after = initializer_bytes(fpath), initializer_bytes(out)
    n_tables = 1 if kind == "tied96" else 2
    q = expected_table_bytes(V, H, bits, group)
    assert sum(after.values()) == sum(before.values()) - n_tables * V * H * 4 + n_tables * q + 8 * 3
    emb = report.modules[0]
    assert (emb.float_bytes, emb.quantized_bytes) == (V * H * 4, q)
    assert report.initializer_bytes_after == sum(after.values())

    # logits: onnxruntime == PyTorch with dequantized tables (float32 rounding only)
    ids = _ids(V)
    got = run_ort(out, ids)
    ref = reference_logits(ckpt, ov, ids)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    # and the quantization did change the model (the float graph differs)
    assert np.abs(run_ort(fpath, ids) - got).max() > 1e-3

    meta = read_metadata(out)
    assert meta["version"] and meta["min_onnxruntime"] == ("1.27" if bits == 4 and not sym else "1.23")
    src = cfg["modules"]["model.embed_tokens"]["source"]["blake3"]
    assert meta["source_blake3"]["model.embed_tokens"] == src
    assert meta["modules"]["model.embed_tokens"]["op"] == "GatherBlockQuantized"
    assert meta["modules"]["lm_head"]["op"] == "MatMulNBits"


def test_untied_head_left_float_without_lm_head(float_model, overlay_for, tmp_path):
    ckpt, fpath = float_model("untied96")
    ov = overlay_for("untied96", 4, 32, True, False)
    out = tmp_path / "q.onnx"
    report = patch_model(fpath, ov, out, accuracy_level=0)  # exact: float activations
    assert [m.op for m in report.modules] == ["GatherBlockQuantized"]
    ops = [n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node]
    assert "MatMulNBits" not in ops and "MatMul" in ops
    ids = _ids(384)
    np.testing.assert_allclose(run_ort(out, ids), reference_logits(ckpt, ov, ids), rtol=1e-5, atol=1e-5)


def test_wrong_overlay_is_refused(float_model, onnx_root, tmp_path):
    """Same architecture and shapes, different weights: the checksum refuses it."""
    import embedq
    _, fpath = float_model("tied96")
    other = build_checkpoint("tied96", tmp_path / "other", seed=1)
    ov = tmp_path / "other-ov"
    embedq.quantize(other, bits=4, output=ov, overlay_only=True, progress=False)
    out = tmp_path / "q.onnx"
    with pytest.raises(OnnxError, match="is not the source of this overlay"):
        patch_model(fpath, ov, out)
    assert not out.exists() and not list(tmp_path.glob(".q.onnx*"))


def test_wrong_model_shape_and_already_patched(float_model, overlay_for, tmp_path):
    _, fpath = float_model("tied96")
    with pytest.raises(OnnxError, match=r"no Gather reads a float \[384, 96\] table"):
        patch_model(fpath, overlay_for("untied96", 8, None), tmp_path / "x.onnx")
    ov = overlay_for("tied96", 8, None)
    patch_model(fpath, ov, tmp_path / "q.onnx")
    with pytest.raises(OnnxError, match="already patched"):
        patch_model(tmp_path / "q.onnx", ov, tmp_path / "q2.onnx")
    with pytest.raises(OnnxError, match="already exists"):
        patch_model(fpath, ov, tmp_path / "q.onnx")


def test_external_data_in_and_out(float_model, overlay_for, tmp_path):
    """The exporter writes external data; the patch copies it (streamed) or inlines it."""
    ckpt, fpath = float_model("tied96")
    assert (fpath.parent / "model.onnx.data").exists()
    ov = overlay_for("tied96", 4, 32, True)
    ext, inl = tmp_path / "ext" / "m.onnx", tmp_path / "inl" / "m.onnx"
    r1 = patch_model(fpath, ov, ext)
    r2 = patch_model(fpath, ov, inl, external_data=False)
    assert r1.external_data and (ext.parent / "m.onnx.data").exists()
    assert not r2.external_data and sorted(p.name for p in inl.parent.iterdir()) == ["m.onnx"]
    mp = onnx.load(str(ext), load_external_data=False)
    for t in mp.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            assert info["location"] == "m.onnx.data"
            if int(info["length"]) >= 1 << 16:
                assert int(info["offset"]) % 4096 == 0
    ids = _ids(512)
    np.testing.assert_array_equal(run_ort(ext, ids), run_ort(inl, ids))
    # patching in place (same model path, same data file name) needs force and works
    import shutil
    inplace = tmp_path / "inplace"
    inplace.mkdir()
    for f in fpath.parent.iterdir():
        shutil.copy(f, inplace / f.name)
    with pytest.raises(OnnxError, match="is the input model"):
        patch_model(inplace / "model.onnx", ov, inplace / "model.onnx")
    r3 = patch_model(inplace / "model.onnx", ov, inplace / "model.onnx", force=True)
    # the new data takes the other generation's name (never the one the old graph reads),
    # the model is renamed last, then the old data goes: one model, one data file
    assert r3.external_data and sorted(p.name for p in inplace.iterdir()) == ["model.onnx", "model.onnx.1.data"]
    np.testing.assert_array_equal(run_ort(inplace / "model.onnx", ids), run_ort(ext, ids))
    # a new graph over it: its data goes back to the first name, the old one is removed
    r4 = patch_model(fpath, ov, inplace / "model.onnx", force=True)
    assert r4.external_data and sorted(p.name for p in inplace.iterdir()) == ["model.onnx", "model.onnx.data"]
    np.testing.assert_array_equal(run_ort(inplace / "model.onnx", ids), run_ort(ext, ids))
