"""Helpers for the ONNX back-end tests (tiny checkpoints, references, byte counts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# hidden 96: per-row -> block 32 (3 blocks), g32 -> 3 blocks: an odd number per row.
#: vocabularies of the exporters' checkpoints (-v4k: a table larger than every other weight)
VOCAB = {"tied96-h32": 512, "untied96-h32": 384, "tied96-h32-v4k": 4096, "untied96-h32-v4k": 4096}
COMMON = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=1,
              num_attention_heads=4, num_key_value_heads=2)


def build_checkpoint(kind: str, path: Path, seed: int = 0) -> Path:
    import transformers as tf
    torch.manual_seed(seed)
    common = dict(COMMON)
    vocab = None
    if kind.endswith("-v4k"):  # a table larger than every other weight (split tests)
        vocab, kind = 4096, kind[:-4]
    if kind.endswith("-h32"):  # head_dim 32: GroupQueryAttention (genai builder) needs a multiple of 16
        common.update(num_attention_heads=3, num_key_value_heads=1)
        kind = kind[:-4]
    if kind == "tied96":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=vocab or 512, tie_word_embeddings=True, **common))
    elif kind == "untied96":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=vocab or 384, tie_word_embeddings=False, **common))
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
    from embedq.backends.onnx import TensorRef
    mp = onnx.load(str(path), load_external_data=False)
    return {i.name: TensorRef(i, path.parent).nbytes() for i in mp.graph.initializer}


# ------------------------------------------------------------ KV-cache graphs (exporters)

def _feeds(sess, ids: np.ndarray, past: dict | None, pos0: int, head_dim: int) -> dict:
    """Inputs of a decoder with KV cache (optimum / onnxruntime-genai builder layouts)."""
    b, s = ids.shape
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = ids.astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((b, pos0 + s), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(pos0, pos0 + s, dtype=np.int64)[None].repeat(b, 0)
        elif i.name.startswith("past_key_values"):
            if past is not None:
                feeds[i.name] = past[i.name]
            else:  # [batch, kv_heads, past_seq = 0, head_dim] (the builder leaves head_dim symbolic)
                dims = [d if isinstance(d, int) else 0 for d in i.shape]
                dims[0], dims[2], dims[3] = b, 0, head_dim
                feeds[i.name] = np.zeros(dims, np.float32)
        else:
            raise KeyError(f"unexpected decoder input {i.name}")
    return feeds


def decoder_session(path: Path):
    import onnxruntime as ort
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def run_decoder(path: Path, ids: torch.Tensor, steps: int = 0, head_dim: int = 24):
    """Prefill logits [b, s, V] of ``ids``, then ``steps`` greedy tokens through the KV cache.

    Returns (prefill logits, greedy tokens [b, steps], logits of each decode step [b, steps, V]).
    """
    sess = decoder_session(path)
    names = [o.name for o in sess.get_outputs()]
    x = ids.numpy()
    out = dict(zip(names, sess.run(None, _feeds(sess, x, None, 0, head_dim))))
    prefill = out["logits"]
    toks, step_logits = [], []
    pos = x.shape[1]
    nxt = prefill[:, -1].argmax(-1)[:, None]
    for _ in range(steps):
        toks.append(nxt[:, 0])
        past = {n.replace("present", "past_key_values"): v for n, v in out.items() if n.startswith("present")}
        out = dict(zip(names, sess.run(None, _feeds(sess, nxt, past, pos, head_dim))))
        step_logits.append(out["logits"][:, -1])
        pos += 1
        nxt = out["logits"][:, -1].argmax(-1)[:, None]
    return prefill, np.stack(toks, 1) if toks else None, np.stack(step_logits, 1) if step_logits else None


def reference_model(ckpt: Path, overlay: Path):
    """transformers model (float32) whose tables are the dequantized overlay."""
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
    return model


def reference_greedy(ckpt: Path, overlay: Path, ids: torch.Tensor, steps: int) -> np.ndarray:
    model = reference_model(ckpt, overlay)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].numpy()


def save_tiny_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer of ``vocab`` tokens (exporters load one beside the weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    words.update({f"w{i}": i for i in range(4, vocab)})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="<pad>").save_pretrained(path)
