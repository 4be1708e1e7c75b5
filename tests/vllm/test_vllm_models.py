"""vLLM's own model classes, engine config, get_model and DefaultModelLoader, on CPU,
loading embedq overlays through the plugin; results against embedq's own dequantization."""

from __future__ import annotations

import json

import pytest
import torch

from _harness import assert_logits_match, load_model, magnitude, param_bytes, prepared, reference, vocab_layers

import _ev as ev

ev.register()

SCHEMES = {
    "q8": dict(bits=8),
    "q4g32": dict(bits=4),  # default group 32
    "q8asym_g16": dict(bits=8, group_size=16, symmetric=False),
    "q4asym_row": dict(bits=4, group_size=None, symmetric=False),
}


def _expected_bytes(rows_padded: int, cfg_entry: dict) -> int:
    """Bytes of the overlay's tensors for one (padded) partition, as on disk."""
    bits, gs, sym = ev.scheme_of(cfg_entry)
    rows, cols = cfg_entry["shape"]
    groups = 1 if gs is None else cols // gs
    sd = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg_entry["scale_dtype"]]
    n = rows_padded * cols * bits // 8 + rows_padded * groups * sd
    if not sym:
        n += -(-rows_padded * bits // 32) * groups * 4  # packed along rows, as on disk
    return n


def _check_embedding(model_dir, layer, module, dtype=torch.bfloat16):
    ref = reference(model_dir, module, dtype)
    vocab = ref.shape[0]
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.tensor([0, vocab - 1]), torch.randint(0, vocab, (62,), generator=g)])
    got = layer(ids)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref[ids], rtol=0, atol=0)
    # the whole served table decodes to the overlay's dequantization, padding rows to 0
    table = layer.quant_method.dequantize_weight(layer, dtype)
    torch.testing.assert_close(table[:vocab], ref, rtol=0, atol=0)
    assert not table[vocab:].any()
    return ref


def _soft_cap(model, logits):
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def _check_logits(model, head, ref, model_dir, module, dtype=torch.bfloat16):
    vocab, hidden = ref.shape
    ref32, mag = reference(model_dir, module, torch.float32), magnitude(model_dir, module)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(5, hidden, generator=g).to(dtype)
    logits = model.compute_logits(h)
    assert logits.shape == (5, vocab)
    # against dequantize-then-matmul in the same dtype, within the fast path's rounding bound
    cap = bool(getattr(model.config, "final_logit_softcapping", None))
    assert_logits_match(logits, _soft_cap(model, torch.nn.functional.linear(h, ref)), h, mag, softcap=cap)
    direct = head.quant_method.apply(head, h)[:, :vocab]
    assert_logits_match(direct, torch.nn.functional.linear(h, ref), h, mag)
    # float32 activations
    direct32 = head.quant_method.apply(head, h.float())[:, :vocab]
    assert_logits_match(direct32, h.float() @ ref32.t(), h.float(), mag)


def _check_memory(model_dir, layer, module):
    """Serving holds the quantized table once: the prepared layout (~ the overlay's bytes),
    the on-disk-layout Parameters released, never a float table."""
    qc = json.loads((model_dir / "quantization_config.json").read_text())
    entry = qc["modules"][module]
    assert layer.weight.numel() == 0  # the float table is not held
    assert layer.weight_packed.dtype == torch.int32
    assert param_bytes(layer) == 16  # only weight_shape (2 x int64) left in the Parameters
    p = prepared(layer)
    overlay = _expected_bytes(layer.num_embeddings_per_partition, entry)
    bits = ev.scheme_of(entry)[0]
    codes = layer.num_embeddings_per_partition * entry["shape"][1] * bits // 8
    # int8: exactly the overlay's bytes; int4 (CPU kernel): scales + zeros in the
    # activation dtype (4 bytes per group instead of 2)
    assert codes < p.nbytes <= overlay * (1.0 if bits == 8 else 1.25), (p.nbytes, overlay, p.kind)
    rows, cols = entry["shape"]
    float_bytes = rows * cols * 2
    assert p.nbytes < float_bytes * (0.75 if bits == 8 else 0.5)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_qwen2_tied(builder, scheme):
    d = builder.quantized("qwen2", scheme, **SCHEMES[scheme])
    vc, model = load_model(d)
    assert vc.model_config.quantization == "embedq"
    embed, head = vocab_layers(model)
    assert isinstance(embed.quant_method, ev.EmbedqMethod)
    assert isinstance(head.quant_method, ev.EmbedqMethod)
    # tied: one table, shared by parameter identity
    assert head.weight_packed is embed.weight_packed and prepared(head) is prepared(embed)
    assert head.weight_scale is embed.weight_scale
    assert prepared(head) is prepared(embed)  # one serving table for gather and head
    names = {n for n, _ in model.named_parameters()}
    assert "lm_head.weight_packed" not in names  # de-duplicated: held once
    ref = _check_embedding(d, embed, "model.embed_tokens")
    _check_logits(model, head, ref, d, "model.embed_tokens")
    _check_memory(d, embed, "model.embed_tokens")


@pytest.mark.parametrize("scheme", ["q8asym_g16", "q4g32"])
def test_fastpath_off_serves_the_kernel_reference(builder, scheme, monkeypatch):
    """EMBEDQ_FASTPATH=0: the kernel layer's one chunked reference serves gather and head
    (no copy of its own in the back end), equal to dequantize-then-matmul at the bound."""
    monkeypatch.setenv("EMBEDQ_FASTPATH", "0")
    d = builder.quantized("qwen2", scheme, **SCHEMES[scheme])
    _, model = load_model(d)
    embed, head = vocab_layers(model)
    assert prepared(head) is prepared(embed) and prepared(head).kind == "chunked"
    ref = _check_embedding(d, embed, "model.embed_tokens")
    _check_logits(model, head, ref, d, "model.embed_tokens")


def test_qwen2_tied_derived(builder):
    d = builder.quantized("qwen2", "q4g32", derived=True, bits=4)
    _, model = load_model(d)
    embed, head = vocab_layers(model)
    assert head.weight_packed is embed.weight_packed and prepared(head) is prepared(embed)
    ref = _check_embedding(d, embed, "model.embed_tokens")
    _check_logits(model, head, ref, d, "model.embed_tokens")


@pytest.mark.parametrize("derived", [False, True], ids=["inplace", "derived"])
def test_llama_untied_quantized_head(builder, derived):
    # Llama builds its embedding without a layer name: matched by shape.
    d = builder.quantized("llama", "q8-head4", derived=derived, bits=8, lm_head=True,
                          head_bits=4, head_group_size=32)
    if not derived:
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert "model.embed_tokens.weight" in index["weight_map"]  # float still in a shard
    _, model = load_model(d)
    embed, head = vocab_layers(model)
    assert isinstance(embed.quant_method, ev.EmbedqMethod)
    assert isinstance(head.quant_method, ev.EmbedqMethod)
    assert head.weight_packed is not embed.weight_packed
    assert prepared(head) is not prepared(embed)
    assert head.quant_method.spec.bits == 4 and embed.quant_method.spec.bits == 8
    _check_embedding(d, embed, "model.embed_tokens")
    ref_head = reference(d, "lm_head")
    _check_logits(model, head, ref_head, d, "lm_head")
    _check_memory(d, embed, "model.embed_tokens")
    _check_memory(d, head, "lm_head")


def test_llama_untied_float_head(builder):
    d = builder.quantized("llama", "q4-embed-only", bits=4)
    _, model = load_model(d)
    embed, head = vocab_layers(model)
    assert isinstance(embed.quant_method, ev.EmbedqMethod)
    assert not isinstance(head.quant_method, ev.EmbedqMethod)
    _check_embedding(d, embed, "model.embed_tokens")
    # the float head loaded from the checkpoint
    from safetensors import safe_open
    index = json.loads((d / "model.safetensors.index.json").read_text())
    with safe_open(str(d / index["weight_map"]["lm_head.weight"]), "pt") as f:
        w = f.get_tensor("lm_head.weight")
    torch.testing.assert_close(head.weight[: w.shape[0]], w)


@pytest.mark.parametrize("scheme", ["q8", "q4g32"])
def test_gemma3_tied(builder, scheme):
    d = builder.quantized("gemma3", scheme, **SCHEMES[scheme])
    _, model = load_model(d)
    embed, head = vocab_layers(model)
    assert head.weight_packed is embed.weight_packed and prepared(head) is prepared(embed)
    ref = _check_embedding(d, embed, "model.embed_tokens")
    _check_logits(model, head, ref, d, "model.embed_tokens")
    # Gemma scales the embedding by sqrt(hidden) in embed_input_ids
    ids = torch.tensor([3, 7, 11])
    normalizer = torch.tensor(model.config.hidden_size ** 0.5, dtype=torch.bfloat16)
    torch.testing.assert_close(model.embed_input_ids(ids), ref[ids] * normalizer)
    _check_memory(d, embed, "model.embed_tokens")


def test_folder_fallback_quantization_flag(builder):
    """config.json untouched, ``--quantization embedq``: vLLM reads quantization_config.json."""
    d = builder.quantized("qwen2", "q8-flag", bits=8)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(cfg))
    vc, model = load_model(d, quantization="embedq")
    assert vc.model_config.quantization == "embedq"
    embed, head = vocab_layers(model)
    _check_embedding(d, embed, "model.embed_tokens")


def test_unloaded_table_is_an_error(builder, tmp_path):
    """An overlay the loader never sees (not in the index) fails loudly, not silently."""
    import shutil
    src = builder.quantized("llama", "q8-unlisted", bits=8)
    d = tmp_path / "m"
    shutil.copytree(src, d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items()
                           if v != "embedq.safetensors" and not k.endswith("weight_packed")
                           and not k.endswith(("weight_scale", "weight_shape"))}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(RuntimeError, match="not loaded"):
        load_model(d)


def test_entry_point_registers_method():
    """The ``vllm.general_plugins`` entry point (pyproject) reaches :func:`register`."""
    from importlib.metadata import entry_points
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "embedq"]
    assert eps, "pyproject.toml lacks: [project.entry-points.\"vllm.general_plugins\"] " \
        + ev.ENTRY_POINT
    assert eps[0].load() is ev.register
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    assert "embedq" in QUANTIZATION_METHODS


def test_plain_engine_config_finds_plugin(builder):
    """What ``vllm serve ./model`` does first, in a fresh process, with no explicit
    register() call: vLLM loads the entry point and picks the embedq method."""
    import subprocess
    import sys
    d = builder.quantized("qwen2", "q8", **SCHEMES["q8"])
    code = ("from vllm.engine.arg_utils import EngineArgs\n"
            f"vc = EngineArgs(model={str(d)!r}, dtype='bfloat16', enforce_eager=True, "
            "max_model_len=128).create_engine_config()\n"
            "print('QUANT', vc.model_config.quantization, type(vc.quant_config).__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "QUANT embedq EmbedqConfig" in r.stdout


def test_gemma_embedding_without_quant_config(builder):
    """vLLM's Gemma builds VocabParallelEmbedding with neither quant_config nor prefix;
    the plugin's out-of-tree VocabParallelEmbedding serves it (and its tied head)."""
    d = builder.quantized("gemma", "q4g32", bits=4)
    _, model = load_model(d)
    embed, head = vocab_layers(model)
    assert type(embed).__name__ == "EmbedqVocabParallelEmbedding"
    assert isinstance(embed.quant_method, ev.EmbedqMethod)
    assert head.weight_packed is embed.weight_packed and prepared(head) is prepared(embed)
    ref = _check_embedding(d, embed, "model.embed_tokens")
    _check_logits(model, head, ref, d, "model.embed_tokens")
    _check_memory(d, embed, "model.embed_tokens")


def test_oot_layer_is_transparent_without_embedq(builder):
    """With the plugin registered, a model without an embedq config is built as usual."""
    d = builder.pristine("gemma")
    vc, model = load_model(d)
    assert vc.model_config.quantization is None
    embed, head = vocab_layers(model)
    assert not isinstance(embed.quant_method, ev.EmbedqMethod)
    assert embed.weight.shape == (384, 64)
    from safetensors import safe_open
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.embed_tokens.weight")
    torch.testing.assert_close(embed.weight[:384], w)


def test_composes_with_base_quantization_config(builder, tmp_path):
    """A checkpoint already quantized with compressed-tensors (W4A16 linears): embedq keeps
    that config as base_quantization_config; vLLM builds the base method for every other
    layer and the embedq method for the embedding and its tied head."""
    import shutil

    from _harness import compress_linears_ct
    d = tmp_path / "ct-base"
    shutil.copytree(builder.pristine("qwen2"), d)
    base_qc = compress_linears_ct(d)
    import embedq
    embedq.quantize(str(d), bits=4, progress=False)
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "embedq"
    assert qc["base_quantization_config"]["quant_method"] == "compressed-tensors"
    vc, model = load_model(d)
    assert vc.model_config.quantization == "embedq"
    assert type(vc.quant_config.base).__name__ == "CompressedTensorsConfig"
    embed, head = vocab_layers(model)
    assert isinstance(embed.quant_method, ev.EmbedqMethod)
    assert head.weight_packed is embed.weight_packed and prepared(head) is prepared(embed)
    ref = _check_embedding(d, embed, "model.embed_tokens")
    _check_logits(model, head, ref, d, "model.embed_tokens")
    layer0 = model.model.layers[0]
    for lin in (layer0.self_attn.qkv_proj, layer0.self_attn.o_proj, layer0.mlp.gate_up_proj,
                layer0.mlp.down_proj):
        assert type(lin.quant_method).__name__ == "CompressedTensorsLinearMethod"
        assert type(lin.scheme).__name__ == "CompressedTensorsWNA16"
    # the base method loaded its tensors (scales are [groups, out] after its processing)
    from safetensors import safe_open
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        scales = [f.get_tensor(f"model.layers.0.self_attn.{p}_proj.weight_scale") for p in "qkv"]
    torch.testing.assert_close(layer0.self_attn.qkv_proj.weight_scale.t(),
                               torch.cat(scales, dim=0))
    assert base_qc["config_groups"]["group_0"]["weights"]["num_bits"] == 4


def test_compressed_tensors_format_loads_in_stock_vllm(builder, tmp_path):
    """``--format compressed-tensors`` (untied, symmetric): vLLM's own compressed-tensors
    method, no embedq code, loads the overlay bytes. (Its embedding forward is Triton-only
    and its WNA16 head needs vLLM's CPU or GPU kernels, so only loading is checked on CPU.)"""
    import embedq
    out = tmp_path / "ct"
    embedq.quantize(str(builder.pristine("llama")), 8, format="compressed-tensors", output=str(out),
                    lm_head=True, head_bits=4, head_group_size=32, progress=False)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == ev.compressed_tensors_config(
        json.loads((out / "quantization_config.json").read_text()))
    vc, model = load_model(out)
    assert vc.model_config.quantization == "compressed-tensors"
    embed, head = vocab_layers(model)
    assert type(embed.quant_method).__name__ == "CompressedTensorsEmbeddingWNA16Int"
    assert type(head.quant_method).__name__ == "CompressedTensorsLinearMethod"
    import embedq
    table = embedq.load_overlay(out).tables["model.embed_tokens"]
    assert torch.equal(embed.weight_packed[: table.rows], table.packed)
    assert torch.equal(embed.weight_scale[: table.rows], table.scale)


def test_compressed_tensors_config_refusals():
    base = {"quant_method": "embedq", "format_version": 1, "aliases": {},
            "tie_word_embeddings": False, "base_quantization_config": None,
            "modules": {"model.embed_tokens": {"num_bits": 8, "type": "int", "symmetric": True,
                                               "strategy": "channel", "group_size": None,
                                               "scale_dtype": "bfloat16", "shape": [8, 64],
                                               "source": {"tensor": "model.embed_tokens.weight"}}}}
    ct = ev.compressed_tensors_config(base)
    assert ct["config_groups"]["group_0"]["targets"] == ["Embedding"]
    tied = dict(base, tie_word_embeddings=True, aliases={"lm_head": "model.embed_tokens"})
    with pytest.raises(ValueError, match="tied"):
        ev.compressed_tensors_config(tied)
    asym = json.loads(json.dumps(base))
    asym["modules"]["model.embed_tokens"]["symmetric"] = False
    with pytest.raises(ValueError, match="asymmetric"):
        ev.compressed_tensors_config(asym)
    with pytest.raises(ValueError, match="already has a quantization_config"):
        ev.compressed_tensors_config(dict(base, base_quantization_config={"quant_method": "fp8"}))


def test_from_config_runs_the_one_parse():
    """docs/security.md row 1: vLLM's ``EmbedqConfig.from_config`` refuses what
    ``format.config.parse_config`` refuses, with its message (the file named)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    good = {"quant_method": "embedq", "format_version": 1, "aliases": {},
            "tie_word_embeddings": False, "base_quantization_config": None,
            "modules": {"model.embed_tokens": {"num_bits": 8, "type": "int", "symmetric": True,
                                               "strategy": "channel", "group_size": None,
                                               "scale_dtype": "bfloat16", "shape": [8, 64],
                                               "source": {"tensor": "model.embed_tokens.weight"}}}}
    bits = json.loads(json.dumps(good))
    bits["modules"]["model.embed_tokens"]["num_bits"] = 2
    other = json.loads(json.dumps(good))
    other["modules"] = {"model.layers.0.mlp.down_proj": dict(
        other["modules"]["model.embed_tokens"], role="head",
        source={"tensor": "model.layers.0.mlp.down_proj.weight"})}
    with set_current_vllm_config(VllmConfig()):
        assert type(ev.EmbedqConfig.from_config(good)) is ev.EmbedqConfig
        with pytest.raises(ValueError, match=r"quantization_config.json: module model.embed_tokens: num_bits"):
            ev.EmbedqConfig.from_config(bits)
        with pytest.raises(ValueError, match=r"module model.layers.0.mlp.down_proj has role 'head' but is not"):
            ev.EmbedqConfig.from_config(other)


def test_mtp_alias_shares_the_owner_table():
    """``aliases`` for an MTP/draft embedding: built in the same model it shares the owner's
    parameters; built alone (a separate draft model) it gets its own quantized parameters
    and tolerates not being loaded (vLLM then shares the target model's embedding)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from _harness import init_single_process
    cfg = {"quant_method": "embedq", "format_version": 1, "tie_word_embeddings": False,
           "aliases": {"mtp.embed_tokens": "model.embed_tokens"},
           "base_quantization_config": None,
           "modules": {"model.embed_tokens": {"num_bits": 4, "type": "int", "symmetric": True,
                                              "strategy": "group", "group_size": 32,
                                              "scale_dtype": "bfloat16", "shape": [200, 64],
                                              # every module names its float source (contract §3)
                                              "source": {"tensor": "model.embed_tokens.weight"}}}}
    with set_current_vllm_config(VllmConfig()):
        init_single_process()
        qc = ev.EmbedqConfig.from_config(cfg)
        owner = VocabParallelEmbedding(200, 64, params_dtype=torch.bfloat16, quant_config=qc,
                                       prefix="model.embed_tokens")
        mtp = VocabParallelEmbedding(200, 64, params_dtype=torch.bfloat16, quant_config=qc,
                                     prefix="mtp.embed_tokens")
        assert mtp.weight_packed is owner.weight_packed and mtp.weight_scale is owner.weight_scale
        draft_qc = ev.EmbedqConfig.from_config(cfg)
        draft = VocabParallelEmbedding(200, 64, params_dtype=torch.bfloat16,
                                       quant_config=draft_qc, prefix="mtp.embed_tokens")
        assert draft.weight_packed.shape == (256, 8)
        draft.quant_method.process_weights_after_loading(draft)  # no error: alias
        with pytest.raises(RuntimeError, match="not loaded"):
            owner.quant_method.process_weights_after_loading(owner)


def test_config_pickles(builder):
    """vLLM pickles VllmConfig (quant config included) into engine-core/worker processes."""
    import pickle
    d = builder.quantized("qwen2", "q4asym_row", **SCHEMES["q4asym_row"])
    from _harness import engine_config
    vc = engine_config(d)
    vc2 = pickle.loads(pickle.dumps(vc))
    qc = vc2.quant_config
    assert type(qc) is ev.EmbedqConfig
    assert qc.modules["model.embed_tokens"].bits == 4
    assert qc.get_min_capability() == -1 and ev.EmbedqConfig.get_min_capability() == -1


def test_gpt2_tied(builder):
    d = builder.quantized("gpt2", "q4g32", bits=4)
    _, model = load_model(d)
    embed, head = vocab_layers(model)
    assert embed.embedq_name == "transformer.wte"
    assert head.weight_packed is embed.weight_packed and prepared(head) is prepared(embed)
    ref = _check_embedding(d, embed, "transformer.wte")
    _check_logits(model, head, ref, d, "transformer.wte")
    _check_memory(d, embed, "transformer.wte")


def test_int8_activations_opt_in(builder, monkeypatch):
    """EMBEDQ_ACTIVATIONS=int8 in the serving process: vLLM's head runs the int8-activation
    row over the one prepared table (gather still bit-exact), equal to the activations as
    embedq.kernels.actquant rounds them times the dequantized table."""
    from embedq.kernels import actquant, dispatch
    if dispatch.layout_unavailable("native"):
        pytest.skip(dispatch.layout_unavailable("native"))
    monkeypatch.setenv("EMBEDQ_ACTIVATIONS", "int8")
    # AMX CPUs keep the exact kernels under the opt-in (faster there): test the int8 row without them
    monkeypatch.setenv("EMBEDQ_CPU_FEATURES", "-amx_bf16,-amx_tile")
    d = builder.quantized("qwen2", "q4g32", **SCHEMES["q4g32"])
    _, model = load_model(d)
    embed, head = vocab_layers(model)
    p = prepared(head)
    assert p is prepared(embed) and p.kind == "native"
    ref = _check_embedding(d, embed, "model.embed_tokens")
    ref32 = reference(d, "model.embed_tokens", torch.float32)
    vocab, hidden = ref.shape
    h = torch.randn(5, hidden, generator=torch.Generator().manual_seed(2))
    for dt in (torch.bfloat16, torch.float32):
        got = head.quant_method.apply(head, h.to(dt))[:, :vocab]
        assert p.last_kernel.endswith("_a8"), p.last_kernel
        q, s = actquant.quantize(h.to(dt))
        xq = actquant.dequantize(q, s).double()
        want = xq @ ref32.double().t()
        bound = (2 * {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}[dt] + hidden * 2.0 ** -24) * (
            xq.abs() @ ref32.double().abs().t()) + 1e-30
        assert ((got.double() - want).abs() <= bound).all()
