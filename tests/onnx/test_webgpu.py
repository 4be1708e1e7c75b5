"""Split graphs on ONNX Runtime's WebGPU EP (Dawn over SwiftShader, scripts/setup_webgpu.sh).

Placement is read from ORT's profile: a kernel the EP cannot run falls back to the CPU EP
silently, and its results would "match". Every GatherBlockQuantized / MatMulNBits part
must run on WebGPU; the nodes that fall back are named here. accuracy_level 0 (float
activations) so the WebGPU, CPU and unsplit logits agree to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedq.backends.onnx import patch_model

import webgpu
from onnxutil import initializer_bytes

TIED, UNTIED = "tied96-v4k", "untied96-v4k"
LIMIT = 64 << 10
WEBGPU = "WebGpuExecutionProvider"
#: What the exported tiny LMs hand to the CPU EP on WebGPU (onnxruntime 1.32, EP 0.4.0): shape
#: and attention-mask plumbing (IsNaN: no WebGPU kernel), and the int64 -> int32 Cast of the
#: split gather's indices (on WebGPU with enableInt64=1).
FALLBACK_OPS = {"Add", "Cast", "Concat", "CumSum", "Equal", "Expand", "GatherND", "IsNaN", "LessOrEqual",
                "Max", "Range", "Reshape", "Shape", "Slice", "Squeeze", "Sub", "Unsqueeze"}


def _ids(vocab: int) -> np.ndarray:
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(5))
    ids[0, :6] = torch.tensor([0, vocab - 1, 585, 586, 1023, 1024])  # ends and part boundaries
    return ids.numpy()


@pytest.mark.parametrize("kind,lm_head", [(TIED, False), (UNTIED, True)])
#: Q4 at g16 (6 blocks per row): the WebGPU EP (0.4.0) refuses 4-bit zero points of rows with an
#: odd number of blocks ("scales and zero_points must have the same shape"; docs/onnx.md).
@pytest.mark.parametrize("bits,group", [(8, None), (4, 16)])
def test_split_on_webgpu_equals_cpu_and_unsplit(float_model, overlay_for, tmp_path, kind, lm_head, bits, group):
    env = webgpu.webgpu_env()  # skips only when scripts/setup_webgpu.sh cannot install
    assert env["ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER"] == "1"
    _, fpath = float_model(kind)
    ov = overlay_for(kind, bits, group, True, lm_head)
    whole, split = tmp_path / "whole.onnx", tmp_path / "split.onnx"
    patch_model(fpath, ov, whole, accuracy_level=0)
    r = patch_model(fpath, ov, split, accuracy_level=0, max_tensor_bytes=LIMIT)
    n = len(r.modules[0].parts)
    assert n >= 4 and max(initializer_bytes(split).values()) <= LIMIT
    feeds = {"input_ids": _ids(4096)}

    gpu = webgpu.run(split, feeds, tmp_path / "runs")
    assert gpu.error is None, gpu.error
    parts = {**gpu.on("GatherBlockQuantized"), **gpu.on("MatMulNBits")}
    assert len(parts) == 2 * n and set(parts.values()) == {WEBGPU}, parts
    fallback = gpu.fallbacks()
    print(f"\n{kind} {bits}-bit, {n} parts on WebGPU (SwiftShader, software renderer): run "
          f"{gpu.seconds:.2f}s; CPU-EP fallbacks: {sorted(set(fallback.values()))}")
    assert set(fallback.values()) <= FALLBACK_OPS, fallback
    # the split's own index arithmetic runs on WebGPU, except the int64 -> int32 Cast
    ours = {k: v for k, v in fallback.items() if "_embedq" in k}
    assert set(ours.values()) <= {"Cast"}, ours

    cpu = webgpu.run(split, feeds, tmp_path / "runs", ep="cpu")
    cpu_whole = webgpu.run(whole, feeds, tmp_path / "runs", ep="cpu")
    got = gpu.outputs["logits"]
    np.testing.assert_allclose(got, cpu.outputs["logits"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, cpu_whole.outputs["logits"], rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == cpu_whole.outputs["logits"].argmax(-1)).all()

    if (kind, bits) != (TIED, 8):
        return
    # enableInt64: the Cast moves onto the EP too
    gpu64 = webgpu.run(split, feeds, tmp_path / "runs", ep_options={"enableInt64": "1"})
    assert gpu64.error is None
    assert not {k: v for k, v in gpu64.fallbacks().items() if "_embedq" in k}
    np.testing.assert_allclose(gpu64.outputs["logits"], got, rtol=1e-5, atol=1e-5)
