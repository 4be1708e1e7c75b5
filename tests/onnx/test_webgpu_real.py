"""Slow WebGPU EP runs (SwiftShader; scripts/setup_webgpu.sh): Gemma 3 270M Q4 split at
32 MiB, and a gather-only table above SwiftShader's 1 GiB maxBufferSize."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest

import webgpu
from onnxutil import initializer_bytes

TEXT = "The capital of France is"
WEBGPU = "WebGpuExecutionProvider"


@pytest.mark.slow
def test_gemma3_270m_q4_split_on_webgpu(gemma3_270m, gemma3_q4_export, tmp_path):
    import embedq
    from transformers import AutoTokenizer

    from embedq.backends.onnx import patch_model
    from embedq.backends.onnx.split import WEBGPU_MAX_BUFFER, row_ranges
    webgpu.webgpu_env()
    ov = tmp_path / "ov"
    embedq.quantize(gemma3_270m, bits=4, output=ov, overlay_only=True, progress=False)
    out = tmp_path / "gemma3-q4-webgpu.onnx"
    limit = 32 << 20
    # the float graph `onnx export` made of Gemma (tests/onnx/conftest.py, shared with
    # test_onnx_real_gemma3: a second torch.onnx export cost ~45 s) patched as
    # `export_model(..., target="webgpu", max_tensor_bytes="32MiB")` patches it; one file,
    # export_model's choice below protobuf's limit
    r = patch_model(gemma3_q4_export["float"], ov, out, accuracy_level=0, external_data=False,
                    target="webgpu", max_tensor_bytes="32MiB")
    V, H = 262144, 640
    emb, head = r.modules
    # --target webgpu alone: 80 MiB of packed rows fit WebGPU's 256 MiB, one part
    assert row_ranges(V, H // 2, WEBGPU_MAX_BUFFER, "t") == [(0, V)]
    assert len(emb.parts) == 3 and [p["rows"] for p in head.parts] == [p["rows"] for p in emb.parts]
    assert head.quantized_bytes == 0 and emb.quantized_bytes == V * H // 2 + V * 20 * 4 + V * 10
    sizes = initializer_bytes(out)
    assert max(sizes.values()) <= limit, max(sizes.items(), key=lambda kv: kv[1])
    assert sum(v for k, v in sizes.items() if re.search(r"\.part\d+$", k)) == emb.quantized_bytes  # one table, shared

    ids = AutoTokenizer.from_pretrained(gemma3_270m)(TEXT, return_tensors="np").input_ids
    feeds = {"input_ids": ids.astype(np.int64)}
    gpu = webgpu.run(out, feeds, tmp_path / "runs", greedy=2)
    assert gpu.error is None, gpu.error
    parts = {**gpu.on("GatherBlockQuantized"), **gpu.on("MatMulNBits")}
    assert len(parts) == 6 and set(parts.values()) == {WEBGPU}, parts
    cpu = webgpu.run(out, feeds, tmp_path / "runs", ep="cpu", greedy=2)
    fb = sorted(set(gpu.fallbacks().values()))
    print(f"\ngemma3-270m q4, 3 parts of <= 32 MiB: WebGPU (SwiftShader, software renderer) forward + "
          f"2 greedy steps {gpu.seconds:.1f}s, CPU EP {cpu.seconds:.1f}s; {ids.shape[1]} positions; "
          f"CPU-EP fallbacks on WebGPU: {fb}")
    g, c = gpu.outputs["logits"], cpu.outputs["logits"]
    assert (g.argmax(-1) == c.argmax(-1)).all()  # the last greedy step's logits, every position
    assert gpu.tokens == cpu.tokens
    assert np.abs(g - c).max() < 1e-2 * np.abs(c).max()


@pytest.mark.slow
def test_gather_above_swiftshader_max_buffer(tmp_path):
    """An int8 table of 1.17 GiB: one initializer above SwiftShader's 1 GiB maxBufferSize fails
    at run time with WebGPU's validation error; split into 256 MiB parts it runs and matches."""
    from onnx import TensorProto, helper, numpy_helper

    from embedq.backends.onnx.split import WEBGPU_MAX_BUFFER, NodeMaker, row_ranges, split_gather
    webgpu.webgpu_env()
    V, H, block = 614_400, 2048, 128  # 1.17 GiB packed
    nb = H // block
    rng = np.random.default_rng(0)
    w = rng.integers(0, 256, (V, H), dtype=np.uint8)
    s = (rng.random((V, nb), dtype=np.float32) + 0.5) / 64
    zp = np.full((V, nb), 128, np.uint8)
    ids = np.array([[0, V - 1, 122_879, 122_880, 245_760, 491_519, 491_520, 12345]], np.int64)  # part ends

    def save(path, nodes, inits):
        g = helper.make_graph(nodes, "gather", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 8])],
                              [helper.make_tensor_value_info("emb", TensorProto.FLOAT, None)], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
        onnx.save(m, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=1024)

    unsplit = tmp_path / "unsplit.onnx"
    save(unsplit, [helper.make_node("GatherBlockQuantized", ["w", "ids", "s", "z"], ["emb"], domain="com.microsoft",
                                    bits=8, block_size=block, gather_axis=0, quantize_axis=1)],
         [numpy_helper.from_array(w, "w"), numpy_helper.from_array(s, "s"), numpy_helper.from_array(zp, "z")])
    names: set[str] = set()

    def fresh(base):
        n, k = base, 1
        while n in names:
            n, k = f"{base}_{k}", k + 1
        names.add(n)
        return n
    mk = NodeMaker(fresh, 18)
    parts, inits = [], []
    for k, (a, b) in enumerate(row_ranges(V, H, WEBGPU_MAX_BUFFER, "table")):
        p = {"start": a, "stop": b, "weight": f"w{k}", "scales": f"s{k}", "zp": f"z{k}"}
        inits += [numpy_helper.from_array(w[a:b], p["weight"]), numpy_helper.from_array(s[a:b], p["scales"]),
                  numpy_helper.from_array(zp[a:b], p["zp"])]
        parts.append(p)
    split_gather(mk, parts, "ids", "emb", "emb", 8, block)
    split = tmp_path / "split.onnx"
    save(split, mk.nodes, inits + mk.inits)
    assert len(parts) == 5 and max(initializer_bytes(split).values()) <= WEBGPU_MAX_BUFFER
    want = ((w[ids[0]].astype(np.float32) - 128).reshape(8, nb, block) * s[ids[0], :, None]).reshape(1, 8, H)
    del w

    bad = webgpu.run(unsplit, {"ids": ids}, tmp_path / "runs")
    assert bad.error is not None and "WebGPU validation failed" in bad.error, bad.error
    assert "Invalid Buffer" in bad.error and "GatherBlockQuantized" in bad.error
    ok = webgpu.run(split, {"ids": ids}, tmp_path / "runs")
    assert ok.error is None, ok.error
    assert set(ok.on("GatherBlockQuantized").values()) == {WEBGPU}
    np.testing.assert_allclose(ok.outputs["emb"], want, rtol=1e-6, atol=1e-6)
    print(f"\n1.17 GiB int8 gather: unsplit fails on WebGPU ({bad.error[:90]}...); 5 parts run in "
          f"{ok.seconds:.1f}s (SwiftShader, software renderer)")
