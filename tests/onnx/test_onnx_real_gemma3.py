"""Real model: Gemma 3 270M (tied, 262144 x 640) exported, patched at 4 bits, run in ORT."""

from __future__ import annotations

import gc
import time

import numpy as np
import onnx
import pytest

import embedq
from embedq.backends.onnx import read_metadata
from onnxutil import reference_logits, run_ort

TEXT = ("The capital of France is Paris. The capital of Germany is Berlin. "
        "Water boils at one hundred degrees Celsius, and the quick brown fox jumps over the")


@pytest.mark.slow
def test_gemma3_270m_export_patch_q4(gemma3_q4_export):
    from transformers import AutoTokenizer
    # quantized in place (Q4 g32 sym) and exported by export_model in the session fixture
    # (tests/onnx/conftest.py), whose float graph test_webgpu_real reuses
    gemma3_copy, out, report = gemma3_q4_export["ckpt"], gemma3_q4_export["out"], gemma3_q4_export["report"]
    t0 = time.perf_counter() - gemma3_q4_export["seconds"]
    V, H = 262144, 640
    emb, head = report.modules
    assert (emb.op, head.op) == ("GatherBlockQuantized", "MatMulNBits")
    assert emb.source_check == "blake3" and head.quantized_bytes == 0  # one shared table
    # embedding bytes: float32 in the float graph, bfloat16 in the checkpoint
    assert emb.float_bytes == V * H * 4
    assert emb.quantized_bytes == V * H // 2 + V * 20 * 4 + V * 10
    assert V * H * 2 / emb.quantized_bytes >= 3.0
    assert emb.float_bytes / emb.quantized_bytes >= 6.0
    mp = onnx.load(str(out), load_external_data=False)
    sizes = {i.name: i for i in mp.graph.initializer}
    assert not [n for n, i in sizes.items() if list(i.dims) in ([V, H], [H, V])]
    assert read_metadata(out)["scheme"] == {"model.embed_tokens": "int4 g32 sym"}

    tok = AutoTokenizer.from_pretrained(gemma3_copy)
    ids = tok(TEXT, return_tensors="pt").input_ids
    got = run_ort(out, ids)
    gc.collect()
    ref = reference_logits(gemma3_copy, gemma3_copy, ids)
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    print(f"\ngemma3-270m q4 onnx: export {report.export_seconds:.0f}s, total "
          f"{time.perf_counter() - t0:.0f}s; embedding {emb.float_bytes / 2**20:.1f} MiB f32 "
          f"({V * H * 2 / 2**20:.1f} MiB bf16) -> {emb.quantized_bytes / 2**20:.1f} MiB; "
          f"file {report.file_bytes / 2**20:.1f} MiB; argmax agreement {agree:.3f} over "
          f"{ids.shape[1]} positions; max |logit diff| {np.abs(got - ref).max():.2e}")
    assert got.argmax(-1)[0, -1] == ref.argmax(-1)[0, -1]
    assert agree >= 0.95


@pytest.mark.slow
def test_gemma3_270m_genai_builder_folder(gemma3_270m, tmp_path):
    """The onnxruntime-genai builder's default Gemma 3 graph (tied: Gather of a Transpose of
    the head's [H, V] initializer) patched as a folder; onnxruntime_genai generates what
    transformers with the dequantized table generates (accuracy_level 0: float activations)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch
    import transformers as tf

    from embedq.backends.onnx import patch_model
    repo = Path(__file__).resolve().parents[2]
    import clients
    site = clients.setup("scripts/setup_genai_onnx.sh", "onnxruntime-genai")
    fp32 = tmp_path / "genai-fp32"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([site, str(repo)]))
    subprocess.run([sys.executable, str(repo / "scripts" / "genai_build.py"), "-i", str(gemma3_270m),
                    "-o", str(fp32), "-p", "fp32", "-e", "cpu", "-c", str(tmp_path / "cache")],
                   check=True, env=env, capture_output=True)
    ov = tmp_path / "ov"
    embedq.quantize(gemma3_270m, bits=4, output=ov, overlay_only=True, progress=False)
    out = tmp_path / "genai-q4"
    r = patch_model(fp32, ov, out, accuracy_level=0)
    assert [(m.op, m.replaced, m.source_check) for m in r.modules] == [
        ("GatherBlockQuantized", "lm_head.MatMul.weight", "blake3"),
        ("MatMulNBits", "lm_head.MatMul.weight", "blake3")]
    mp = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert not [i for i in mp.graph.initializer if sorted(i.dims) == [640, 262144]]
    del mp
    if site not in sys.path:
        sys.path.append(site)
    import onnxruntime_genai as og
    model = og.Model(str(out))
    ids = og.Tokenizer(model).encode("The capital of France is")
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=1024)  # >= Gemma's sliding window
    g = og.Generator(model, params)
    g.append_tokens(ids)
    got = []
    while len(got) < 12:
        g.generate_next_token()
        got.append(int(g.get_next_tokens()[0]))
    del g, model
    gc.collect()
    ref = tf.AutoModelForCausalLM.from_pretrained(gemma3_270m, dtype=torch.float32).eval()
    with torch.no_grad():
        ref.get_input_embeddings().weight.copy_(
            embedq.load_overlay(ov).tables["model.embed_tokens"].dequantize(torch.float32))
        x = torch.tensor([list(ids)])
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
    assert got == want[0, x.shape[1]:].tolist()
