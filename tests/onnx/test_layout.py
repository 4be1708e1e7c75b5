"""Block layout, zero-point repacking and hand-built graphs (float16, Gemm, [H, V] heads)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from embedq.backends.onnx import (OnnxError, onnx_block_size, ort_scales, ort_weight_bytes,
                                  ort_zero_points, patch_model)
from embedq.format.codec import pack_zero_points, unpack_zero_points
from embedq.quant.rtn import quantize_rtn
from embedq.format.scheme import Scheme
from embedq.format.codec import QuantizedTable


@pytest.mark.parametrize("bits,group,cols,block", [
    (8, None, 640, 128), (8, None, 96, 32), (4, 32, 96, 32), (8, 48, 96, 16),
    (4, None, 2048, 2048), (4, 64, 640, 64), (8, None, 1536, 512)])
def test_block_size(bits, group, cols, block):
    assert onnx_block_size(bits, group, cols) == block
    # quantization_config.json's "onnx" section promises the same block
    from embedq.format.config import onnx_block_size as config_block
    assert config_block(Scheme(bits=bits, group_size=group), cols) == block


@pytest.mark.parametrize("group,cols", [(None, 40), (24, 96), (8, 64)])
def test_block_size_refuses_small_blocks(group, cols):
    with pytest.raises(OnnxError, match="power-of-two block >= 16"):
        onnx_block_size(8, group, cols)
    from embedq.format.config import onnx_block_size as config_block
    assert config_block(Scheme(bits=8, group_size=group), cols) is None


def _table(bits, group, cols, sym, rows=37, seed=0) -> QuantizedTable:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 0.05 + 0.01
    s = Scheme(bits=bits, symmetric=sym, group_size=group)
    q, scale, zp = quantize_rtn(x, s, torch.bfloat16)
    if zp is not None:  # through compressed-tensors' on-disk layout and back
        zp = unpack_zero_points(pack_zero_points(zp, bits), bits, rows)
    return QuantizedTable.from_codes(q, scale, zp, bits, group)


@pytest.mark.parametrize("bits,group,cols,sym", [
    (4, 32, 96, False), (4, 32, 96, True), (4, 32, 64, False), (8, 32, 96, False),
    (8, None, 96, False), (4, None, 96, False), (4, 96, 96, False), (8, 48, 96, False)])
def test_zero_points_and_scales_in_ort_layout(bits, group, cols, sym):
    """Element by element: block j of row r carries group (j*block)//g's scale and zp."""
    t = _table(bits, group, cols, sym)
    block = onnx_block_size(bits, group, cols)
    nb, g = cols // block, (cols if group is None else group)
    zp = ort_zero_points(t, block)
    sc = ort_scales(t, block, torch.float32)
    assert zp.dtype == np.uint8 and zp.shape == (t.rows, -(-nb * bits // 8))
    assert sc.dtype == np.float32 and sc.shape == (t.rows, nb)
    for r in range(t.rows):
        for j in range(nb):
            grp = j * block // g
            want = (1 << (bits - 1)) + (0 if sym else int(t.zero_point[r, grp]))
            if bits == 8:
                got = zp[r, j]
            else:
                got = (zp[r, j // 2] >> (4 * (j % 2))) & 0xF
            assert got == want, (r, j)
            assert sc[r, j] == float(t.scale[r, grp])
        if bits == 4 and nb % 2:
            assert zp[r, -1] >> 4 == 1 << (bits - 1)  # padding nibble: the midpoint
    # and the ORT formula reproduces the overlay's dequantization
    u = t.codes().to(torch.int16).numpy() + (1 << (bits - 1))
    zpu = np.empty((t.rows, nb), np.int16)
    for j in range(nb):
        zpu[:, j] = zp[:, j] if bits == 8 else (zp[:, j // 2] >> (4 * (j % 2))) & 0xF
    deq = ((u.reshape(t.rows, nb, block) - zpu[..., None]) * sc[..., None]).reshape(t.rows, cols)
    np.testing.assert_array_equal(deq, t.dequantize(torch.float32).numpy())
    wb = ort_weight_bytes(t)
    assert wb.dtype == np.uint8 and wb.shape == (t.rows, cols * bits // 8)


# ----------------------------------------------------------- hand-built graphs

def _graph(table: np.ndarray, elem: int, head: str, transposed_head: np.ndarray | None = None):
    """ids -> Gather(table); x -> head(x, table) as MatMul/Gemm; returns ModelProto."""
    V, H = table.shape
    inits = [numpy_helper.from_array(table, "E")]
    nodes = [helper.make_node("Gather", ["E", "ids"], ["emb"], name="gather")]
    if head == "gemm":
        nodes.append(helper.make_node("Gemm", ["x", "E"], ["logits"], transB=1, name="gemm"))
    elif head == "matmul_ht":
        inits.append(numpy_helper.from_array(transposed_head, "Et"))
        nodes.append(helper.make_node("MatMul", ["x", "Et"], ["logits"], name="mm"))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TP.INT64, ["n"]),
                                       helper.make_tensor_value_info("x", elem, ["b", H])],
                          [helper.make_tensor_value_info("emb", elem, ["n", H]),
                           helper.make_tensor_value_info("logits", elem, ["b", V])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _source_table(ckpt) -> torch.Tensor:
    from safetensors import safe_open
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight")


def _run(path, ids, x):
    import onnxruntime as ort
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(None, {"ids": ids, "x": x})


def test_float16_graph_with_gemm_head(float_model, overlay_for, tmp_path):
    """A float16 graph of a bfloat16 model: float16 scales, Gemm(transB=1) head."""
    import embedq
    ckpt, _ = float_model("tied96")
    ov = overlay_for("tied96", 4, 32, False)
    E = _source_table(ckpt)
    src = tmp_path / "f16.onnx"
    onnx.save(_graph(E.to(torch.float16).numpy(), TP.FLOAT16, "gemm"), str(src))
    out = tmp_path / "q.onnx"
    r = patch_model(src, ov, out)
    assert [m.op for m in r.modules] == ["GatherBlockQuantized", "MatMulNBits"]
    # bf16 -> f16 is not exact for the smallest values: checked by sampled rows
    assert r.modules[0].source_check == "sampled-rows"
    mp = onnx.load(str(out))
    assert {i.name: i.data_type for i in mp.graph.initializer}["model.embed_tokens.qscales"] == TP.FLOAT16
    deq = embedq.load_overlay(ov).tables["model.embed_tokens"].dequantize(torch.float32)
    ids = np.array([0, 5, 511, 7], np.int64)
    x = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float16)
    emb, logits = _run(out, ids, x)
    np.testing.assert_allclose(emb.astype(np.float32), deq[ids].to(torch.float16).float().numpy(),
                               rtol=1e-3, atol=1e-4)
    ref = x.astype(np.float32) @ deq.numpy().T
    np.testing.assert_allclose(logits.astype(np.float32), ref, rtol=2e-2, atol=2e-2)


def test_dequantized_graph_and_transposed_head_copy(float_model, overlay_for, tmp_path):
    """A graph made from the dequantized table (e.g. exported from a derived checkpoint),
    with the head stored as a separate transposed [H, V] copy: both are recognised and
    replaced by one shared uint8 table."""
    import embedq
    ckpt, _ = float_model("tied96")
    ov = overlay_for("tied96", 8, None)
    deq = embedq.load_overlay(ov).tables["model.embed_tokens"].dequantize(torch.float32).numpy()
    src = tmp_path / "deq.onnx"
    onnx.save(_graph(deq, TP.FLOAT, "matmul_ht", np.ascontiguousarray(deq.T)), str(src))
    out = tmp_path / "q.onnx"
    r = patch_model(src, ov, out, accuracy_level=0)
    assert [(m.op, m.source_check) for m in r.modules] == [
        ("GatherBlockQuantized", "dequantized"), ("MatMulNBits", "dequantized")]
    assert [m.float_bytes for m in r.modules] == [512 * 96 * 4] * 2
    names = {i.name for i in onnx.load(str(out)).graph.initializer}
    assert "E" not in names and "Et" not in names
    ids = np.arange(512, dtype=np.int64)
    x = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float32)
    emb, logits = _run(out, ids, x)
    np.testing.assert_array_equal(emb, deq)
    np.testing.assert_allclose(logits, x @ deq.T, rtol=1e-5, atol=1e-5)


def test_lossy_graph_of_another_table_is_refused(float_model, overlay_for, tmp_path):
    ckpt, _ = float_model("tied96")
    ov = overlay_for("tied96", 4, 32, True)
    E = _source_table(ckpt).float()
    E = E + 0.5 * E.std() * torch.randn(E.shape, generator=torch.Generator().manual_seed(0))
    src = tmp_path / "other.onnx"
    onnx.save(_graph(E.to(torch.float16).numpy(), TP.FLOAT16, "gemm"), str(src))
    with pytest.raises(OnnxError, match="not within quantization error"):
        patch_model(src, ov, tmp_path / "q.onnx")


def test_bfloat16_graph_is_refused(float_model, overlay_for, tmp_path):
    ckpt, _ = float_model("tied96")
    ov = overlay_for("tied96", 8, None)
    E = _source_table(ckpt)
    t = TP(name="E", data_type=TP.BFLOAT16, dims=list(E.shape),
           raw_data=E.view(torch.int16).numpy().tobytes())
    mp = _graph(np.zeros(E.shape, np.float32), TP.BFLOAT16, "gemm")
    mp.graph.initializer[0].CopyFrom(t)
    src = tmp_path / "bf16.onnx"
    onnx.save(mp, str(src))
    with pytest.raises(OnnxError, match="bfloat16; ONNX Runtime's CPU kernels"):
        patch_model(src, ov, tmp_path / "q.onnx")


def test_second_table_of_the_same_shape_is_left_alone(float_model, overlay_for, tmp_path):
    """Two Gathers of [V, H] tables: only the overlay's source is replaced."""
    ckpt, _ = float_model("tied96")
    ov = overlay_for("tied96", 8, None)
    E = _source_table(ckpt).float().numpy()
    mp = _graph(E, TP.FLOAT, "gemm")
    other = np.random.default_rng(0).standard_normal(E.shape).astype(np.float32)
    mp.graph.initializer.insert(0, numpy_helper.from_array(other, "Other"))
    mp.graph.node.insert(0, helper.make_node("Gather", ["Other", "ids"], ["emb2"], name="g2"))
    mp.graph.output.append(helper.make_tensor_value_info("emb2", TP.FLOAT, ["n", 96]))
    src = tmp_path / "two.onnx"
    onnx.save(mp, str(src))
    r = patch_model(src, ov, tmp_path / "q.onnx")
    assert [(m.op, m.replaced) for m in r.modules] == [("GatherBlockQuantized", "E"), ("MatMulNBits", "E")]
    assert any("Other" in w and "left as is" in w for w in r.warnings)
    out = onnx.load(str(tmp_path / "q.onnx"))
    assert [n.op_type for n in out.graph.node].count("Gather") == 1
    assert "Other" in {i.name for i in out.graph.initializer}
    # and with a wrong overlay neither is the source: refused
    with pytest.raises(OnnxError, match="none of the float"):
        patch_model(src, _other_overlay(tmp_path), tmp_path / "x.onnx")


def _other_overlay(tmp_path):
    import embedq
    from onnxutil import build_checkpoint
    other = build_checkpoint("tied96", tmp_path / "other", seed=5)
    embedq.quantize(other, bits=8, progress=False)
    return other
