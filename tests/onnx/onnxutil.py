"""Helpers for the ONNX back-end tests (tiny checkpoints, references, byte counts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# hidden 96: per-row -> block 32 (3 blocks), g32 -> 3 blocks: an odd number per row.
COMMON = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2)


def build_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    import transformers as tf
    torch.manual_seed(seed)
    if kind == "tied96":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=512, tie_word_embeddings=True, **COMMON))
    elif kind == "untied96":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=384, tie_word_embeddings=False, **COMMON))
    else:
        raise KeyError(kind)
    m.to(torch.bfloat16).save_pretrained(path)
    return path


def reference_logits(ckpt: Path, overlay: Path, ids: torch.Tensor) -> np.ndarray:
    """PyTorch logits (float32) with the tables replaced by the dequantized overlay."""
    import embedq
    from embedq.backends.onnx import load_float_model
    model = load_float_model(ckpt)
    ov = embedq.load_overlay(overlay)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        for name, entry in ov.config["modules"].items():
            w = head if entry.get("role") == "head" else emb
            w.copy_(ov.tables[name].dequantize(torch.float32))
        return model(input_ids=ids, use_cache=False).logits.numpy()


def run_ort(path: Path, ids: torch.Tensor) -> np.ndarray:
    import onnxruntime as ort
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"input_ids": ids.numpy()})[0]


def initializer_bytes(path: Path) -> dict[str, int]:
    """name -> bytes of every initializer (external data not read)."""
    import onnx
    from embedq.backends.onnx import _Tensor
    mp = onnx.load(str(path), load_external_data=False)
    return {i.name: _Tensor(i, path.parent).nbytes() for i in mp.graph.initializer}
