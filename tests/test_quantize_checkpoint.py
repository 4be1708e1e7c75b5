"""End-to-end `embedq quantize` on tiny real transformers checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import embedq
from ckptutil import snapshot
from embedq.errors import OverlayError, TieError
from embedq.format.reader import load_overlay


def _source_table(path, name):
    idx = path / "model.safetensors.index.json"
    file = json.loads(idx.read_text())["weight_map"][name] if idx.exists() else "model.safetensors"
    with safe_open(path / file, "pt") as f:
        return f.get_tensor(name)


def _check_against_source(path, module, tensor):
    ov = load_overlay(path)
    t = ov.tables[module]
    x = _source_table(path, tensor).float()
    step = t.scale.float().abs().repeat_interleave(t.cols // t.scale.shape[1], dim=1)
    err = (t.dequantize(torch.float32) - x).abs()
    # 4-bit sym (signed-max): a value of the other sign than the group's extreme may be
    # clipped to code 7, missing by up to one step
    factor = 1.0 if t.bits == 4 and t.zero_point is None else 0.5
    assert bool((err <= step * factor * (1 + 1e-5) + 1e-7).all())


@pytest.mark.parametrize("bits,kw", [(8, {}), (4, {}), (4, {"symmetric": False}), (8, {"group_size": 32})])
def test_tied_qwen2_in_place_and_remove(model_factory, bits, kw):
    path = model_factory("qwen2_tied")
    before = snapshot(path)
    report = embedq.quantize(path, bits=bits, progress=False, **kw)
    assert report.tied and len(report.modules) == 1
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc == json.loads((path / "quantization_config.json").read_text())
    assert qc["aliases"] == {"lm_head": "model.embed_tokens"}
    assert qc["onnx"]["lm_head"]["op"] == "MatMulNBits"
    keys = load_file(path / "embedq.safetensors").keys()
    assert not any(k.endswith("lm_head.weight") for k in keys)
    assert "model.embed_tokens.weight_packed" in keys
    # source shards untouched
    after = snapshot(path)
    assert after["model.safetensors"] == before["model.safetensors"]
    _check_against_source(path, "model.embed_tokens", "model.embed_tokens.weight")
    v = embedq.verify(path)
    assert v.modules[0].max_abs_error == pytest.approx(report.modules[0].max_abs_error)
    embedq.remove(path)
    assert snapshot(path) == before


def test_untied_sharded_llama_with_lm_head(model_factory):
    path = model_factory("llama_untied_sharded")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 3
    assert index["model.embed_tokens.weight"] != index["lm_head.weight"]
    before = snapshot(path)
    rep = embedq.quantize(path, bits=8, lm_head=True, head_bits=4, head_group_size=32, progress=False)
    assert [m.module for m in rep.modules] == ["model.embed_tokens", "lm_head"]
    assert rep.modules[1].scheme == "int4 g32 sym"
    qc = json.loads((path / "quantization_config.json").read_text())
    assert qc["tie_word_embeddings"] is False and qc["aliases"] == {}
    new_index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert new_index["lm_head.weight_packed"] == "embedq.safetensors"
    assert new_index["lm_head.weight"] == index["lm_head.weight"]
    _check_against_source(path, "lm_head", "lm_head.weight")
    # vLLM unties a model whose files contain lm_head.weight: the overlay must not
    assert not any(k.endswith("lm_head.weight") for k in load_file(path / "embedq.safetensors"))
    for f, h in before.items():
        if f.endswith(".safetensors"):
            assert snapshot(path)[f] == h
    embedq.remove(path)
    assert snapshot(path) == before


def test_untied_without_lm_head_flag_quantizes_only_embedding(model_factory):
    path = model_factory("llama_untied_fp32")
    rep = embedq.quantize(path, bits=8, progress=False)
    assert [m.module for m in rep.modules] == ["model.embed_tokens"]
    assert rep.modules[0].source_dtype == "float32"
    assert load_overlay(path).tables["model.embed_tokens"].scale.dtype == torch.float32


def test_gemma3_tied(model_factory):
    path = model_factory("gemma3_tied")
    rep = embedq.quantize(path, bits=4, progress=False)
    assert rep.tied and rep.modules[0].aliases == ["lm_head"]
    embedq.verify(path)


def test_multimodal_nested_config(model_factory):
    path = model_factory("llava_nested")
    rep = embedq.quantize(path, bits=8, lm_head=True, progress=False)
    mods = [m.module for m in rep.modules]
    assert mods == ["language_model.model.embed_tokens", "language_model.lm_head"]
    _check_against_source(path, mods[0], mods[0] + ".weight")


def test_already_overlaid_needs_force(model_factory):
    path = model_factory("qwen2_tied")
    before = snapshot(path)
    embedq.quantize(path, bits=8, progress=False)
    with pytest.raises(OverlayError, match="already has an embedq overlay"):
        embedq.quantize(path, bits=4, progress=False)
    rep = embedq.quantize(path, bits=4, force=True, progress=False)
    assert rep.modules[0].scheme == "int4 g32 sym"
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["modules"]["model.embed_tokens"]["num_bits"] == 4
    assert qc["base_quantization_config"] is None
    embedq.remove(path)
    assert snapshot(path) == before


def test_verify_detects_changed_base(model_factory):
    path = model_factory("qwen2_tied")
    embedq.quantize(path, bits=8, progress=False)
    sd = load_file(path / "model.safetensors")
    sd["model.embed_tokens.weight"][0, 0] += 1
    from safetensors.torch import save_file
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(OverlayError, match="changed since the overlay was made"):
        embedq.verify(path)


def test_verify_detects_corrupted_overlay(model_factory):
    path = model_factory("qwen2_tied")
    embedq.quantize(path, bits=8, progress=False)
    data = bytearray((path / "embedq.safetensors").read_bytes())
    data[-100] ^= 0xFF
    (path / "embedq.safetensors").write_bytes(bytes(data))
    with pytest.raises(OverlayError, match="checksum"):
        embedq.verify(path)


def test_existing_quantization_config_is_kept_as_base(model_factory):
    path = model_factory("qwen2_tied")
    cfg = json.loads((path / "config.json").read_text())
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    cfg["quantization_config"] = fp8
    (path / "config.json").write_text(json.dumps(cfg))
    embedq.quantize(path, bits=8, progress=False)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "embedq" and qc["base_quantization_config"] == fp8
    embedq.remove(path)
    assert json.loads((path / "config.json").read_text())["quantization_config"] == fp8


# --- ties ------------------------------------------------------------------------------

def _set_config(path, **kv):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(kv)
    (path / "config.json").write_text(json.dumps(cfg))


def test_config_tied_but_tensors_differ_is_refused(model_factory):
    path = model_factory("llama_untied_fp32")
    _set_config(path, tie_word_embeddings=True)
    before = snapshot(path)
    with pytest.raises(TieError, match="tie_word_embeddings=true but lm_head.weight differs"):
        embedq.quantize(path, bits=8, progress=False)
    assert snapshot(path) == before
    rep = embedq.quantize(path, bits=8, trust="tensors", lm_head=True, progress=False)
    assert not rep.tied and len(rep.modules) == 2


def test_config_untied_but_no_head_is_refused(model_factory):
    path = model_factory("qwen2_tied")
    _set_config(path, tie_word_embeddings=False)
    with pytest.raises(TieError, match="no lm_head tensor"):
        embedq.quantize(path, bits=8, progress=False)
    rep = embedq.quantize(path, bits=8, trust="tensors", progress=False)
    assert rep.tied


def test_tied_with_identical_head_tensor_stays_tied(model_factory):
    path = model_factory("qwen2_tied")
    sd = load_file(path / "model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    from safetensors.torch import save_file
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    rep = embedq.quantize(path, bits=8, output=path.parent / "derived", progress=False)
    assert rep.tied and len(rep.modules) == 1
    # the derived checkpoint must not carry the duplicate float head either
    names = json.loads((path.parent / "derived" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" not in names


def test_tied_head_bits_unties_in_quantized_form(model_factory):
    path = model_factory("qwen2_tied")
    rep = embedq.quantize(path, bits=4, head_bits=8, progress=False)
    assert [m.module for m in rep.modules] == ["model.embed_tokens", "lm_head"]
    qc = json.loads((path / "quantization_config.json").read_text())
    assert qc["aliases"] == {} and qc["modules"]["lm_head"]["source"]["tensor"] == "model.embed_tokens.weight"
    assert qc["modules"]["lm_head"]["num_bits"] == 8


def test_mtp_embedding_alias_and_copy(model_factory):
    path = model_factory("qwen2_tied")
    sd = load_file(path / "model.safetensors")
    emb = sd["model.embed_tokens.weight"]
    sd["mtp.embed_tokens.weight"] = emb.clone()
    sd["model.mtp.1.embed_tokens.weight"] = (emb.float() * 1.5).to(emb.dtype)
    from safetensors.torch import save_file
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    rep = embedq.quantize(path, bits=8, progress=False)
    qc = json.loads((path / "quantization_config.json").read_text())
    assert qc["aliases"]["mtp.embed_tokens"] == "model.embed_tokens"
    assert "model.mtp.1.embed_tokens" in qc["modules"]
    assert {m.module for m in rep.modules} == {"model.embed_tokens", "model.mtp.1.embed_tokens"}


# --- derived ---------------------------------------------------------------------------

def test_derived_checkpoint(model_factory):
    path = model_factory("llama_untied_sharded")
    before = snapshot(path)
    out = path.parent / "derived"
    rep = embedq.quantize(path, bits=4, lm_head=True, output=out, progress=False)
    assert snapshot(path) == before  # source folder completely untouched
    assert rep.mode == "derived" and rep.output == str(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    assert "model.embed_tokens.weight" not in wm and "lm_head.weight" not in wm
    assert wm["model.embed_tokens.weight_packed"] == "embedq.safetensors"
    total = 0
    for f in set(wm.values()):
        with safe_open(out / f, "pt") as sf:
            for k in sf.keys():
                assert wm[k] == f
                total += sf.get_slice(k).get_shape() and sf.get_tensor(k).numel() * sf.get_tensor(k).element_size()
    assert index["metadata"]["total_size"] == total
    # unchanged shards are hard links of the source
    src_index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    untouched = set(src_index.values()) - {src_index["model.embed_tokens.weight"], src_index["lm_head.weight"]}
    for f in untouched:
        assert os.stat(out / f).st_ino == os.stat(path / f).st_ino
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "embedq"
    assert (out / "generation_config.json").exists()
    assert not list(out.parent.glob(".*partial*"))
    embedq.verify(out)
    with pytest.raises(OverlayError, match="not empty"):
        embedq.quantize(path, bits=4, output=out, progress=False)
    embedq.quantize(path, bits=8, output=out, force=True, progress=False)
    with pytest.raises(OverlayError, match="derived"):
        embedq.remove(out)


def test_derived_single_file_rewrites_without_table(model_factory):
    path = model_factory("qwen2_tied")
    out = path.parent / "d"
    embedq.quantize(path, bits=8, output=out, progress=False)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
    with safe_open(path / "model.safetensors", "pt") as f:
        src = {k: f.get_tensor(k) for k in f.keys()}
    assert keys == set(src) - {"model.embed_tokens.weight"}
    assert meta == {"format": "pt"}
    got = load_file(out / "model.safetensors")
    for k in keys:
        assert torch.equal(got[k], src[k])


@pytest.mark.parametrize("bits,kw", [(8, {}), (4, {"symmetric": False}), (8, {"group_size": 16, "symmetric": False})])
def test_overlay_file_decompresses_with_compressed_tensors(model_factory, bits, kw):
    """The overlay on disk, read by safetensors and decompressed by compressed-tensors."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    path = model_factory("llama_untied_sharded")
    embedq.quantize(path, bits=bits, lm_head=True, progress=False, **kw)
    qc = json.loads((path / "quantization_config.json").read_text())
    tensors = load_file(path / "embedq.safetensors")
    for module, e in qc["modules"].items():
        args = QuantizationArgs(num_bits=e["num_bits"], type="int", symmetric=e["symmetric"],
                                strategy=e["strategy"], group_size=e["group_size"])
        sd = {k[len(module) + 1:]: v for k, v in tensors.items() if k.startswith(module + ".")}
        w = PackedQuantizationCompressor.decompress(sd, QuantizationScheme(targets=["Embedding"], weights=args))["weight"]
        x = _source_table(path, e["source"]["tensor"]).float()
        scale = sd["weight_scale"].float()
        step = scale.repeat_interleave(x.shape[1] // scale.shape[1], dim=1)
        # ct returns bf16: allow its final rounding on top of half a step
        assert bool(((w.float() - x).abs() <= step / 2 + x.abs() * 2 ** -8 + 1e-6).all())
        assert torch.equal(w, load_overlay(path).tables[module].dequantize(torch.bfloat16))
