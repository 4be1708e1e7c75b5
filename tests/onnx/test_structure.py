"""Recognition by structure of every layout exporters produce (hand-built graphs), unsafe
external data locations, and the CLI without the onnx extra."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from embedq.backends.onnx import OnnxError, patch_model, read_metadata


def _source(ckpt) -> np.ndarray:
    from safetensors import safe_open
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float().numpy()


def _layout_graph(E: np.ndarray, layout: str):
    """ids -> embedding (``emb``), x -> logits, with the table stored and reached as named."""
    V, H = E.shape
    n = helper.make_node
    inits, nodes = [], []
    if layout == "gather-init/matmul-transpose":  # torch dynamo / optimum, tied
        inits = [numpy_helper.from_array(E, "E")]
        nodes = [n("Gather", ["E", "ids"], ["emb"]), n("Transpose", ["E"], ["Et"], perm=[1, 0]),
                 n("MatMul", ["x", "Et"], ["logits"])]
    elif layout == "gather-transpose/matmul-init":  # onnxruntime-genai builder, tied (default)
        inits = [numpy_helper.from_array(np.ascontiguousarray(E.T), "lm_head.MatMul.weight")]
        nodes = [n("Transpose", ["lm_head.MatMul.weight"], ["Et"], perm=[1, 0]),
                 n("Gather", ["Et", "ids"], ["emb"]), n("MatMul", ["x", "lm_head.MatMul.weight"], ["logits"])]
    elif layout == "gather-identity-transpose/gemm-transB0":
        inits = [numpy_helper.from_array(np.ascontiguousarray(E.T), "W")]
        nodes = [n("Identity", ["W"], ["W1"]), n("Transpose", ["W1"], ["Et"], perm=[1, 0]),
                 n("Identity", ["Et"], ["Et1"]), n("Gather", ["Et1", "ids"], ["emb"]),
                 n("Gemm", ["x", "W1"], ["logits"])]
    elif layout == "gather-identity/gemm-transB1-identity":
        inits = [numpy_helper.from_array(E, "E")]
        nodes = [n("Identity", ["E"], ["E1"]), n("Gather", ["E1", "ids"], ["emb"]),
                 n("Gemm", ["x", "E1"], ["logits"], transB=1)]
    elif layout == "gather-init/matmul-transpose-transpose":  # two Transposes cancel
        inits = [numpy_helper.from_array(np.ascontiguousarray(E.T), "W")]
        nodes = [n("Transpose", ["W"], ["E1"], perm=[1, 0]), n("Gather", ["E1", "ids"], ["emb"]),
                 n("Transpose", ["E1"], ["W2"], perm=[1, 0]), n("MatMul", ["x", "W2"], ["logits"])]
    else:
        raise KeyError(layout)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TP.INT64, ["n"]),
                                       helper.make_tensor_value_info("x", TP.FLOAT, ["b", H])],
                          [helper.make_tensor_value_info("emb", TP.FLOAT, ["n", H]),
                           helper.make_tensor_value_info("logits", TP.FLOAT, ["b", V])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


LAYOUTS = ["gather-init/matmul-transpose", "gather-transpose/matmul-init",
           "gather-identity-transpose/gemm-transB0", "gather-identity/gemm-transB1-identity",
           "gather-init/matmul-transpose-transpose"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_tied_layout(float_model, overlay_for, tmp_path, layout):
    """Tied table in each stored orientation and path: one quantized table, float table,
    Identity and Transpose nodes gone, values = the dequantized overlay."""
    import onnxruntime as ort
    ckpt, _ = float_model("tied96")
    ov = overlay_for("tied96", 4, 32, True)
    E = _source(ckpt)
    src = tmp_path / "m.onnx"
    onnx.save(_layout_graph(E, layout), str(src))
    out = tmp_path / "q.onnx"
    r = patch_model(src, ov, out, accuracy_level=0)
    assert [(m.op, m.source_check) for m in r.modules] == [
        ("GatherBlockQuantized", "blake3"), ("MatMulNBits", "blake3")]
    assert r.modules[0].replaced == r.modules[1].replaced and r.modules[1].quantized_bytes == 0
    mp = onnx.load(str(out))
    assert {n.op_type for n in mp.graph.node} == {"GatherBlockQuantized", "MatMulNBits", "Reshape"}
    assert not [i.name for i in mp.graph.initializer if sorted(i.dims) == [96, 512]]
    import embedq
    deq = embedq.load_overlay(ov).tables["model.embed_tokens"].dequantize(torch.float32).numpy()
    ids = np.arange(512, dtype=np.int64)
    x = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float32)
    s = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    emb, logits = s.run(None, {"ids": ids, "x": x})
    np.testing.assert_array_equal(emb, deq)
    np.testing.assert_allclose(logits, x @ deq.T, rtol=1e-5, atol=1e-5)


def test_non_2d_transpose_is_not_followed(float_model, overlay_for, tmp_path):
    """A Transpose with another perm is not a view of the table: refused, not guessed."""
    ckpt, _ = float_model("tied96")
    ov = overlay_for("tied96", 8, None)
    mp = _layout_graph(_source(ckpt), "gather-transpose/matmul-init")
    mp.graph.node[0].attribute[0].ints[:] = [0, 1]
    src = tmp_path / "m.onnx"
    onnx.save(mp, str(src))
    with pytest.raises(OnnxError, match="no Gather reads a float"):
        patch_model(src, ov, tmp_path / "q.onnx")


def test_accuracy_level_default_override_and_speed_path(float_model, overlay_for, tmp_path):
    """CPU default 4 (int8 activations: ORT's fast path), overridable, recorded."""
    ckpt, fpath = float_model("tied96")
    ov = overlay_for("tied96", 8, None)
    r = patch_model(fpath, ov, tmp_path / "d.onnx")
    assert r.accuracy_level == 4 and read_metadata(tmp_path / "d.onnx")["accuracy_level"] == "4"
    r = patch_model(fpath, ov, tmp_path / "c.onnx", execution_provider="cuda")
    assert r.accuracy_level == 0
    r = patch_model(fpath, ov, tmp_path / "o.onnx", accuracy_level=1, execution_provider="cuda")
    assert r.accuracy_level == 1
    with pytest.raises(OnnxError, match="accuracy_level 5"):
        patch_model(fpath, ov, tmp_path / "x.onnx", accuracy_level=5)


# ------------------------------------------------------------- external data locations

@pytest.mark.parametrize("where", ["../secret.bin", "ABS", "sub/../../secret.bin", "link.bin"])
def test_external_data_outside_the_folder_is_refused(float_model, overlay_for, tmp_path, where, monkeypatch):
    """A model whose external data points outside its folder (relative escape, absolute
    path, symlink) would make patch read that file and copy it into the output: refused
    before anything is read, and nothing is written."""
    ckpt, _ = float_model("tied96")
    ov = overlay_for("tied96", 8, None)
    E = _source(ckpt)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(E.tobytes())  # the exact table: only the location check can stop it
    before = secret.stat()
    mdir = tmp_path / "model"
    mdir.mkdir()
    mp = _layout_graph(E, "gather-init/matmul-transpose")
    t = mp.graph.initializer[0]
    loc = str(secret) if where == "ABS" else where
    if where == "link.bin":
        os.symlink(secret, mdir / "link.bin")
    t.ClearField("raw_data")
    t.data_location = TP.EXTERNAL
    for k, v in (("location", loc), ("offset", "0"), ("length", str(E.nbytes))):
        e = t.external_data.add()
        e.key, e.value = k, v
    src = mdir / "model.onnx"
    src.write_bytes(mp.SerializeToString())

    opened: list[str] = []
    real_open, real_memmap = open, np.memmap
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: (opened.append(str(f)), real_open(f, *a, **k))[1])
    monkeypatch.setattr(np, "memmap", lambda f, *a, **k: (opened.append(str(f)), real_memmap(f, *a, **k))[1])
    out = tmp_path / "out" / "q.onnx"
    with pytest.raises(OnnxError, match="not a relative path inside the model's folder") as e:
        patch_model(src, ov, out, external_data=True)
    assert str(src) in str(e.value) and repr(loc) in str(e.value)
    assert not any(Path(p).resolve() == secret.resolve() for p in opened if p), opened
    assert not out.parent.exists() or not any(out.parent.iterdir())
    assert secret.stat().st_mtime_ns == before.st_mtime_ns and secret.read_bytes() == E.tobytes()


def test_external_data_inside_the_folder_still_works(float_model, overlay_for, tmp_path):
    ckpt, _ = float_model("tied96")
    ov = overlay_for("tied96", 8, None)
    mdir = tmp_path / "m"
    (mdir / "weights").mkdir(parents=True)
    mp = _layout_graph(_source(ckpt), "gather-init/matmul-transpose")
    onnx.save(mp, str(mdir / "model.onnx"), save_as_external_data=True,
              location="weights/./table.bin", size_threshold=0)
    r = patch_model(mdir / "model.onnx", ov, tmp_path / "q.onnx")
    assert r.modules[0].source_check == "blake3"


# ------------------------------------------------------------------ without the extra

def test_cli_without_onnx_says_how_to_install(monkeypatch):
    from typer.testing import CliRunner

    from embedq.cli import app
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx -> ImportError
    for argv in (["onnx", "patch", "m.onnx", "--overlay", ".", "-o", "q.onnx"],
                 ["onnx", "export", ".", "-o", "q.onnx"]):
        res = CliRunner().invoke(app, argv)
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert res.exit_code == 2, res.output
        assert len(lines) == 1 and lines[0].startswith("embedq: error: ")
        assert "pip install 'embedq[onnx]'" in lines[0]
