"""Probe an onnxruntime build for the facts docs/onnx.md relies on (not a pytest module).

    pip install --no-deps --target /tmp/ort-1.26.0 onnxruntime==1.26.0
    PYTHONPATH=/tmp/ort-1.26.0 python tests/onnx/ort_version_probe.py

Prints, per case, the max error of GatherBlockQuantized / MatMulNBits (uint8 data, 2-D
scales and zero points, the MatMulNBits weight a Reshape of the gather table) against a
numpy dequantization. 0 / ~1e-7 means exact; ~1 means mis-decoded.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh


def case(bits: int, H: int, block: int, zp_kind: str, pad: int, V: int = 37, seed: int = 0):
    rng = np.random.default_rng(seed)
    nb = H // block
    u = rng.integers(0, 1 << bits, size=(V, H), dtype=np.uint8)
    if zp_kind == "asym":
        zpu = rng.integers(0, 1 << bits, size=(V, nb), dtype=np.uint8)
    else:
        zpu = np.full((V, nb), 1 << (bits - 1), np.uint8)
    sc = (rng.random((V, nb)) * 0.1 + 0.01).astype(np.float32)
    if bits == 4:
        data = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)
        z = np.concatenate([zpu, np.full((V, nb % 2), pad, np.uint8)], 1)
        zpp = (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)
    else:
        data, zpp = u, zpu
    deq = ((u.astype(np.float32).reshape(V, nb, block) - zpu[..., None]) * sc[..., None]).reshape(V, H)
    inits = [nh.from_array(data, "W"), nh.from_array(sc, "S"), nh.from_array(zpp, "Z"),
             nh.from_array(np.array([V, nb, block * bits // 8], np.int64), "shape3d")]
    nodes = [h.make_node("GatherBlockQuantized", ["W", "ids", "S", "Z"], ["emb"], domain="com.microsoft",
                         bits=bits, block_size=block, gather_axis=0, quantize_axis=1),
             h.make_node("Reshape", ["W", "shape3d"], ["W3"]),
             h.make_node("MatMulNBits", ["x", "W3", "S", "Z"], ["y"], domain="com.microsoft",
                         K=H, N=V, bits=bits, block_size=block)]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("ids", TP.INT64, [None]),
                                  h.make_tensor_value_info("x", TP.FLOAT, [None, H])],
                     [h.make_tensor_value_info("emb", TP.FLOAT, [None, H]),
                      h.make_tensor_value_info("y", TP.FLOAT, [None, V])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18), h.make_opsetid("com.microsoft", 1)])
    m.ir_version = 9
    x = rng.standard_normal((3, H)).astype(np.float32)
    try:
        s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        e, y = s.run(None, {"ids": np.arange(V, dtype=np.int64), "x": x})
    except Exception as ex:  # older builds reject the graph
        return f"rejected: {str(ex).splitlines()[0][-90:]}"
    ref = x @ deq.T
    return f"gather {np.abs(e - deq).max():.1e}  matmul {np.abs(y - ref).max() / np.abs(ref).max():.1e}"


def main() -> None:
    print("onnxruntime", ort.__version__)
    for bits, H, block in ((4, 96, 32), (4, 64, 32), (4, 640, 128), (8, 96, 32), (8, 640, 128)):
        nb = H // block
        for zp_kind in ("sym", "asym"):
            pads = (0, 1 << (bits - 1)) if bits == 4 and nb % 2 else (0,)
            for pad in pads:
                label = f"int{bits} H={H} block={block} ({nb} blocks) {zp_kind}"
                if len(pads) > 1:
                    label += f" pad-nibble={pad}"
                print(f"  {label:<48} {case(bits, H, block, zp_kind, pad)}")


if __name__ == "__main__":
    main()
