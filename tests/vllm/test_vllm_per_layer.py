"""Gemma 3n's per-layer input embedding (overlay role ``per_layer``, ``quantize
--per-layer-embeddings``) served as an embedq gather by vLLM's own Gemma3nForCausalLM, which
names the layer ``per_layer_embed_tokens`` (layers.VLLM_SPELLINGS); results against the float
model holding both tables' dequantized values, loaded by vLLM the same way."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from _harness import (assert_logits_match, dispatch_layout, load_model, magnitude, param_bytes,
                      prepared, reference, vocab_layers)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))
from archs import build_tiny  # noqa: E402

import _ev as ev  # noqa: E402

ev.register()

EMB, PLE = "model.embed_tokens", "model.embed_tokens_per_layer"
# The per-layer table 200 x 96 (4 layers x 24; fewer rows than the vocabulary, as in the real
# models) apart from the 256 x 64 embedding (the tiny build's default makes both 256 x 64).
SHAPE = dict(vocab_size_per_layer_input=200, hidden_size_per_layer_input=24)


def tiny_gemma3n(path: Path) -> Path:
    """A tiny tied Gemma3nForCausalLM (tests/checkpoints/archs.py) with SHAPE."""
    return build_tiny("Gemma3nForCausalLM", "gemma3n_text", path, overrides=SHAPE)


def dequantized_copy(src: Path, quantized: Path, dst: Path, modules=(EMB, PLE)) -> Path:
    """``src`` (float) whose ``modules`` hold ``quantized``'s dequantized tables."""
    import embedq
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    ov = embedq.load_overlay(quantized)
    (f,) = dst.glob("*.safetensors")  # tiny: one file
    sd = load_file(str(f))
    for m in modules:
        t = sd[f"{m}.weight"]
        table = ov.table_for(m).dequantize(t.dtype)
        assert table.shape == t.shape
        sd[f"{m}.weight"] = table.contiguous()
    save_file(sd, str(f), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return tiny_gemma3n(tmp_path_factory.mktemp("gemma3n") / "float")


def _quantized(src: Path, dst: Path, **kw) -> Path:
    import embedq
    shutil.copytree(src, dst)
    embedq.quantize(str(dst), progress=False, **kw)
    return dst


def _layers(model):
    """(embedding, per-layer embedding) layers of vLLM's Gemma3nForCausalLM."""
    embed, _ = vocab_layers(model, EMB)
    (ple,) = [m for n, m in model.named_modules() if n.endswith(".embed_tokens_per_layer")]
    return embed, ple


def _same_inputs(model, ref_model, vocab: int) -> None:
    """Embeddings, per-layer embeddings (ids past the per-layer vocabulary read row 0) and the
    per-layer inputs the decoder layers get (projection, norm) equal the reference model's
    exactly: a gather is exact, and everything after it is the same code on the same values.
    The per-layer embeddings are taken as vLLM's Gemma3nForConditionalGeneration takes them
    (gemma3n_mm.py, embed_input_ids); its text-only Gemma3nForCausalLM passes none to the
    decoder (per_layer_inputs=None: the projection alone), so no forward of it reads them."""
    cfg = model.config
    ids = torch.arange(vocab)
    with torch.no_grad():
        got, want = [], []
        for m, out in ((model, got), (ref_model, want)):
            dec = m.model.self_decoder
            emb = m.embed_input_ids(ids)
            per = m.model.get_per_layer_input_embeddings(ids).reshape(
                -1, cfg.num_hidden_layers, cfg.hidden_size_per_layer_input)
            out += [emb, per, dec.get_per_layer_inputs(emb, per)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("bits", [8, 4])
def test_gemma3n_per_layer_served_by_embedq(pristine, tmp_path, bits, monkeypatch):
    q = _quantized(pristine, tmp_path / f"q{bits}", bits=bits, per_layer_embeddings=True)
    _, model = load_model(q)
    embed, ple = _layers(model)
    for layer, module in ((embed, EMB), (ple, PLE)):
        assert isinstance(layer.quant_method, ev.EmbedqMethod), (module, layer.quant_method)
        assert layer.embedq_name == module
        assert prepared(layer).kind == dispatch_layout(q, module)
        assert param_bytes(layer) == 16  # weight_shape only: no float table held
    assert ple.prefix.endswith(".per_layer_embed_tokens")  # vLLM's spelling
    assert ple.quant_method.spec.bits == bits
    ref_ple = reference(q, PLE)
    assert tuple(ref_ple.shape) == (200, 96)
    torch.testing.assert_close(ple(torch.arange(200)), ref_ple, rtol=0, atol=0)
    _, ref_model = load_model(dequantized_copy(pristine, q, tmp_path / f"deq{bits}"))
    assert not any(isinstance(m.quant_method, ev.EmbedqMethod) for m in _layers(ref_model))
    calls = []  # the model's per-layer gather runs through embedq's method
    orig = ev.EmbedqMethod.embedding
    monkeypatch.setattr(ev.EmbedqMethod, "embedding",
                        lambda self, layer, x: calls.append(self.name) or orig(self, layer, x))
    _same_inputs(model, ref_model, reference(q, EMB).shape[0])
    assert sorted(calls) == [EMB, PLE], calls
    # the tied head: logits against the reference model's, at the fast path's bound
    h = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    h = h.to(torch.bfloat16)
    assert_logits_match(model.compute_logits(h), ref_model.compute_logits(h), h,
                        magnitude(q, EMB), softcap=True)


def test_gemma3n_without_flag_serves_per_layer_float(pristine, tmp_path):
    """Without ``--per-layer-embeddings`` the overlay holds the embedding only; vLLM serves
    the per-layer table as loaded from the checkpoint."""
    import json
    q = _quantized(pristine, tmp_path / "q8", bits=8)
    assert PLE not in json.loads((q / "quantization_config.json").read_text())["modules"]
    _, model = load_model(q)
    embed, ple = _layers(model)
    assert isinstance(embed.quant_method, ev.EmbedqMethod)
    assert not isinstance(ple.quant_method, ev.EmbedqMethod)
    from safetensors import safe_open
    with safe_open(str(q / "model.safetensors"), "pt") as f:
        w = f.get_tensor(f"{PLE}.weight")
    torch.testing.assert_close(ple.weight[: w.shape[0]], w, rtol=0, atol=0)
    _, ref_model = load_model(dequantized_copy(pristine, q, tmp_path / "deq8", modules=(EMB,)))
    _same_inputs(model, ref_model, reference(q, EMB).shape[0])


def test_resolve_gemma3n_layer_names(pristine, tmp_path):
    """``EmbedqConfig.resolve`` on vLLM's layer names: the text-only class's, and those of
    Gemma3nForConditionalGeneration (the real checkpoints' class; gemma3n_mm.py builds its
    text model as a Gemma3nForCausalLM under ``language_model``, and the checkpoints name the
    tables ``model.language_model.*``: not buildable here, its vision tower needs timm), also
    where the two tables have one shape; a layer of another name matches neither."""
    import json

    from vllm.config import VllmConfig, set_current_vllm_config
    q = _quantized(pristine, tmp_path / "q8", bits=8, per_layer_embeddings=True)
    text = json.loads((q / "quantization_config.json").read_text())
    mm = json.loads(json.dumps(text).replace('"model.', '"model.language_model.'))
    same = json.loads(json.dumps(mm))
    same["modules"]["model.language_model.embed_tokens_per_layer"]["shape"] = [256, 64]
    same.pop("onnx", None)  # optional; derived from the shapes
    dec = "model.self_decoder."
    with set_current_vllm_config(VllmConfig()):
        for cfg, root, ple_shape in ((text, "", (200, 96)), (mm, "language_model.", (200, 96)),
                                     (same, "language_model.", (256, 64))):
            qc = ev.EmbedqConfig.from_config(cfg)
            emb, ple = sorted(cfg["modules"], key=lambda n: n.endswith("_per_layer"))
            assert qc.resolve(root + dec + "per_layer_embed_tokens", False, *ple_shape) == ple
            assert qc.resolve(root + dec + "embed_tokens", False, 256, 64) == emb
            assert qc.resolve("embed_vision.embedding", False, *ple_shape) is None
