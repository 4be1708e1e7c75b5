"""Encoders: a tiny all-MiniLM-L6-v2-shaped BertModel, quantized; embedq.load picks
BertModel from config.json ``architectures`` and returns the float model's hidden states
with the dequantized table; sentence-transformers loads the same folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import embedq
from embedq.backends.transformers import QuantizedEmbedding

WORDS = ["hello", "world", "quantized", "tables", "embed", "##q", "the", "a", "of", "model"]


def _tiny_bert(path: Path) -> Path:
    import transformers as tf
    torch.manual_seed(0)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + [f"w{i}" for i in range(497)]
    cfg = tf.BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    tf.BertModel(cfg, add_pooling_layer=True).save_pretrained(path)
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tf.BertTokenizer(str(path / "vocab.txt")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("enc")
    src = _tiny_bert(root / "float")
    q = root / "q8"
    import shutil
    shutil.copytree(src, q)
    d = embedq.inspect(q)
    assert [r["tensor"] for r in d["tensors"]] == ["embeddings.word_embeddings.weight"]
    assert d["head_module"] is None  # an encoder has no output embedding: no alias
    embedq.quantize(q, bits=8, progress=False)
    return src, q


def _float_with_table(src: Path, q: Path):
    import transformers as tf
    m = tf.BertModel.from_pretrained(src).eval()
    ref = embedq.load_overlay(q).table_for("embeddings.word_embeddings").dequantize(torch.float32)
    with torch.no_grad():
        m.embeddings.word_embeddings.weight.copy_(ref)
    return m


def test_load_bert_hidden_states(bert):
    import transformers as tf
    src, q = bert
    qc = json.loads((q / "quantization_config.json").read_text())
    assert list(qc["modules"]) == ["embeddings.word_embeddings"] and not qc.get("aliases")
    model = embedq.load(q).eval()
    assert type(model) is tf.BertModel
    assert isinstance(model.embeddings.word_embeddings, QuantizedEmbedding)
    ref = _float_with_table(src, q)
    ids = torch.tensor([[2, 5, 6, 7, 8, 3], [2, 9, 10, 11, 3, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
        want = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_sentence_transformers(bert):
    # In the `test` extra (pyproject.toml): a missing install fails here, never skips.
    import sentence_transformers as st
    from sentence_transformers.sentence_transformer import modules as models
    src, q = bert
    sentences = ["hello world", "quantized embed tables of the model"]

    def encode(path):
        tr = models.Transformer(str(path), max_seq_length=32)
        pool = models.Pooling(tr.get_embedding_dimension(), pooling_mode="mean")
        return st.SentenceTransformer(modules=[tr, pool], device="cpu").encode(
            sentences, convert_to_tensor=True)

    got = encode(q)  # plain AutoModel.from_pretrained inside: `import embedq` registered it
    # the float model with the dequantized table, same pipeline
    ref_dir = src.parent / "ref"
    _float_with_table(src, q).save_pretrained(ref_dir)
    for f in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"):
        if (src / f).exists():
            (ref_dir / f).write_bytes((src / f).read_bytes())
    want = encode(ref_dir)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
