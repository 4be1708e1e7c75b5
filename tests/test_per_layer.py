"""Per-layer input embeddings (``--per-layer-embeddings``, role ``per_layer``) end to end on the
tiny Gemma 3n text model (``embed_tokens`` and ``embed_tokens_per_layer``: both 256x64, so
every back end must tell them apart by name or source, never by shape): transformers
loading, verify / remove / apply / inspect / ``--json``, ONNX patching, GGUF transcoding (or the note),
format-level and CLI refusals."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "checkpoints"))
sys.path.insert(0, str(Path(__file__).parent / "quality"))
from archs import build_tiny  # noqa: E402
from ckptutil import assert_one_line_error, run_cli, snapshot  # noqa: E402
from qualutil import assert_model_logits_match, assert_same_greedy  # noqa: E402

import embedq  # noqa: E402
from embedq.backends.transformers import QuantizedEmbedding, QuantizedLMHead, resolve_targets  # noqa: E402
from embedq.errors import EmbedqError, OverlayError  # noqa: E402

EMB, PL = "model.embed_tokens", "model.embed_tokens_per_layer"
IDS = torch.tensor([[1, 5, 7, 9, 11, 200, 3, 4, 5, 6, 7, 8, 9, 10, 250, 2]])
GGUF8 = ["--bits", "8", "--group-size", "32", "--scale-dtype", "float16"]


@pytest.fixture(scope="session")
def _pristine(tmp_path_factory) -> Path:
    return build_tiny("Gemma3nForCausalLM", "gemma3n_text", tmp_path_factory.mktemp("g3n") / "gemma3n")


@pytest.fixture
def gemma3n(_pristine, tmp_path) -> Path:
    """A fresh copy of the tiny Gemma 3n (tied; both tables 256x64 bf16)."""
    return Path(shutil.copytree(_pristine, tmp_path / "gemma3n"))


def _float_model(path: Path, cls, dtype):
    from embedq.quality.evaluate import load_reference
    return load_reference(path, cls, dtype)  # the float model (embedq's config stripped)


def _tables(path: Path, dtype) -> dict[str, torch.Tensor]:
    ov = embedq.load_overlay(path)
    return {m: ov.tables[m].dequantize(dtype) for m in ov.tables}


# ------------------------------------------------------------------ transformers

@pytest.mark.parametrize("bits", [8, 4])
def test_transformers_logits_equal_dequantized_float_model(gemma3n, bits):
    """Both tables are QuantizedEmbeddings (each its own table, each its module's embed_scale);
    logits equal the float model whose two tables hold the overlay's dequantized values."""
    rep = embedq.quantize(gemma3n, bits, per_layer_embeddings=True, progress=False)
    assert {m.module: m.role for m in rep.modules} == {EMB: "embedding", PL: "per_layer"}
    model = embedq.load(gemma3n).eval()
    ref = _float_model(gemma3n, type(model), model.dtype).eval()
    q_pl, q_emb = model.model.embed_tokens_per_layer, model.model.embed_tokens
    assert isinstance(q_pl, QuantizedEmbedding) and isinstance(q_emb, QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLMHead) and model.lm_head.table is q_emb.table
    assert q_pl.table is not q_emb.table
    # Gemma3nTextScaledWordEmbedding's scale, each module its own: sqrt(16) and sqrt(64)
    f_pl, f_emb = ref.model.embed_tokens_per_layer, ref.model.embed_tokens
    assert type(f_pl).__name__ == "Gemma3nTextScaledWordEmbedding"
    assert q_pl.embed_scale_spec == ("tensor", f_pl.scalar_embed_scale) == ("tensor", 16 ** 0.5)
    assert q_emb.embed_scale_spec == ("tensor", f_emb.scalar_embed_scale) == ("tensor", 64 ** 0.5)
    deq = _tables(gemma3n, model.dtype)
    assert not torch.equal(deq[EMB], deq[PL])
    with torch.no_grad():  # by exact name (in place: the tied head follows the embedding)
        f_emb.weight.copy_(deq[EMB])
        f_pl.weight.copy_(deq[PL])
        ids = torch.arange(256)
        assert torch.equal(q_pl(ids), f_pl(ids)) and torch.equal(q_emb(ids), f_emb(ids))
    assert_model_logits_match(model, ref, IDS)  # the body's output bit for bit, the head in bound
    assert_same_greedy(model, ref, IDS, 4)


def test_without_the_flag_the_per_layer_table_stays_float(gemma3n):
    rep = embedq.quantize(gemma3n, 8, progress=False)
    assert [m.module for m in rep.modules] == [EMB]
    assert any(PL + ".weight" in w and "--per-layer-embeddings" in w for w in rep.warnings)
    model = embedq.load(gemma3n)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert type(model.model.embed_tokens_per_layer).__name__ == "Gemma3nTextScaledWordEmbedding"


def _cfg(modules: dict[str, str], aliases: dict[str, str] | None = None):
    return SimpleNamespace(modules={n: SimpleNamespace(role=r) for n, r in modules.items()},
                           aliases=aliases or {})


def test_resolution_exact_names_first(gemma3n):
    """Same-shaped tables map by name; a checkpoint layout other than the module tree falls
    back to the input embedding and a unique suffix; a fallback never takes a module another
    table already replaces."""
    import transformers
    model = _float_model(gemma3n, transformers.Gemma3nForCausalLM, torch.bfloat16)
    got = resolve_targets(model, _cfg({EMB: "embedding", PL: "per_layer"}, {"lm_head": EMB}))
    assert got == {EMB: (EMB, "embedding"), PL: (PL, "embedding"), "lm_head": (EMB, "head")}
    # the per-layer table listed first, another layout: still each to its own module
    other = {"language_model.model.embed_tokens_per_layer": "per_layer",
             "language_model.model.embed_tokens": "embedding"}
    got = resolve_targets(model, _cfg(other))
    assert got == {PL: ("language_model.model.embed_tokens_per_layer", "embedding"),
                   EMB: ("language_model.model.embed_tokens", "embedding")}
    with pytest.raises(OverlayError, match=f"maps to {EMB}, which {EMB} already replaces"):
        resolve_targets(model, _cfg({EMB: "embedding", "draft.wte": "embedding"}))


def test_mtp_table_never_replaces_the_input_embedding(model_factory):
    """An MTP table the model class does not build (model.mtp.1.embed_tokens) found no
    module by name; its suffix fallback once landed on model.embed_tokens, serving the MTP
    table as the input embedding. Now it is skipped."""
    from safetensors.torch import load_file, save_file
    path = model_factory("qwen2_tied")
    sd = load_file(path / "model.safetensors")
    sd["model.mtp.1.embed_tokens.weight"] = (sd[EMB + ".weight"].float() * 1.5).to(torch.bfloat16)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    embedq.quantize(path, bits=8, progress=False)
    assert "model.mtp.1.embed_tokens" in embedq.load_overlay(path).tables
    model = embedq.load(path)
    ids = torch.arange(20)
    assert torch.equal(model.model.embed_tokens(ids), _tables(path, model.dtype)[EMB][ids])


def test_mtp_listed_first_does_not_take_the_input_embedding(gemma3n):
    """Config order does not decide: an MTP table listed before an input embedding that
    matches only by fallback is resolved after it (and skipped), not the other way round."""
    import transformers
    model = _float_model(gemma3n, transformers.Gemma3nForCausalLM, torch.bfloat16)
    got = resolve_targets(model, _cfg({"model.mtp.1.embed_tokens": "mtp",
                                       "language_model.model.embed_tokens": "embedding"}))
    assert got == {EMB: ("language_model.model.embed_tokens", "embedding")}


def test_eval_takes_ids_past_a_smaller_per_layer_table(tmp_path):
    """Gemma 3n's per-layer table has fewer rows than the vocabulary (the model maps the
    ids past it to 0): ``embedq eval`` checks ids against the vocabulary tables only."""
    from embedq.quality.evaluate import evaluate
    path = build_tiny("Gemma3nForCausalLM", "gemma3n_text", tmp_path / "g",
                      overrides={"vocab_size_per_layer_input": 200})
    embedq.quantize(path, bits=8, per_layer_embeddings=True, progress=False)
    assert embedq.load_overlay(path).tables[PL].rows == 200
    r = evaluate(path, tokens=[5, 210, 17, 240, 33] * 8, contexts=1, length=40, bos=None,
                 progress=False, bootstrap=10)
    assert r.tokens > 0 and r.mean_kld >= 0


def test_card_names_the_per_layer_table(gemma3n, tmp_path):
    """A derived checkpoint's card says every quantized table (it said "its token embedding",
    every other tensor the source's, with the per-layer table quantized too)."""
    out = tmp_path / "derived"
    embedq.quantize(gemma3n, bits=8, per_layer_embeddings=True, output=out, progress=False)
    text = (out / "README.md").read_text()
    assert "with its token embedding and per-layer embedding quantized by embedq" in text


# ------------------------------------------------------------------ verify / remove / apply / inspect

def test_quantize_verify_remove_round_trip(gemma3n):
    before = snapshot(gemma3n)
    code, out = run_cli("quantize", gemma3n, "--bits", "4", "--per-layer-embeddings", "--json", "-q")
    assert code == 0, out
    rep = json.loads(out)
    mods = {m["module"]: m for m in rep["modules"]}
    assert mods[PL]["role"] == "per_layer" and mods[PL]["tensor"] == PL + ".weight"
    assert mods[PL]["bytes_before"] == 256 * 64 * 2 and mods[PL]["aliases"] == []
    assert rep["bytes_before"] == 2 * 256 * 64 * 2
    qc = json.loads((gemma3n / "quantization_config.json").read_text())
    assert qc["modules"][PL]["role"] == "per_layer" and qc["onnx"][PL]["op"] == "GatherBlockQuantized"
    code, out = run_cli("verify", gemma3n, "--json")
    assert code == 0, out
    ver = {m["module"]: m for m in json.loads(out)["modules"]}
    assert ver[PL]["role"] == "per_layer" and ver[PL]["max_abs_error"] is not None  # checked vs the source
    code, out = run_cli("verify", gemma3n)
    assert code == 0 and "overlay OK" in out and PL in out, out
    code, out = run_cli("remove", gemma3n)
    assert code == 0, out
    assert snapshot(gemma3n) == before  # config.json byte for byte, nothing left


def test_verify_catches_a_corrupt_per_layer_table(gemma3n):
    embedq.quantize(gemma3n, 8, per_layer_embeddings=True, progress=False)
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    f = gemma3n / "embedq.safetensors"
    with safe_open(str(f), "pt") as h:
        meta = h.metadata()
    sd = load_file(f)
    sd[PL + ".weight_packed"][3, 0] ^= 0x7F
    save_file(sd, f, metadata=meta)
    code, out = run_cli("verify", gemma3n)
    assert_one_line_error(code, out, PL + ".weight_packed", "checksum")


def test_apply_overlay_bundle_onto_a_float_copy(gemma3n, tmp_path):
    src = Path(shutil.copytree(gemma3n, tmp_path / "src"))
    bundle = tmp_path / "bundle"
    code, out = run_cli("quantize", src, "--bits", "8", "--per-layer-embeddings", "--output", bundle,
                        "--overlay-only", "-q")
    assert code == 0, out
    before = snapshot(gemma3n)
    code, out = run_cli("apply", gemma3n, "--overlay", bundle, "--json")
    assert code == 0, out
    assert {m["module"]: m["role"] for m in json.loads(out)["modules"]} == {EMB: "embedding", PL: "per_layer"}
    assert (gemma3n / "embedq.safetensors").read_bytes() == (bundle / "embedq.safetensors").read_bytes()
    code, out = run_cli("verify", gemma3n)
    assert code == 0, out
    model = embedq.load(gemma3n)
    assert isinstance(model.model.embed_tokens_per_layer, QuantizedEmbedding)
    code, out = run_cli("remove", gemma3n)
    assert code == 0 and snapshot(gemma3n) == before, out


def test_inspect_lists_the_per_layer_table(gemma3n, tmp_path):
    """inspect's per-layer row: its bytes now, and after int8 / Q4 g32 exactly what quantize
    --per-layer-embeddings writes for it."""
    d = embedq.inspect(gemma3n).to_dict()
    rows = {r["role"]: r for r in d["tensors"]}
    assert [r["role"] for r in d["tensors"]] == ["embedding", "per_layer"]
    pl = rows["per_layer"]
    assert (pl["tensor"], pl["shape"], pl["dtype"], pl["bytes"]) == (PL + ".weight", [256, 64], "BF16", 32768)
    for bits, key in ((8, "bytes_int8"), (4, "bytes_q4_g32")):
        rep = embedq.quantize(gemma3n, bits, per_layer_embeddings=True, output=tmp_path / f"q{bits}",
                              overlay_only=True, progress=False)
        assert pl[key] == next(m.bytes_after for m in rep.modules if m.role == "per_layer"), key
    code, out = run_cli("inspect", gemma3n)
    assert code == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("per_layer "))
    assert PL + ".weight" in line and "256x64" in line
    assert "--per-layer-embeddings" in out
    code, out = run_cli("inspect", gemma3n, "--json")
    assert code == 0 and json.loads(out)["tensors"][1]["role"] == "per_layer", out


# ------------------------------------------------------------------ ONNX

def _onnx_graph(tables: dict[str, "np.ndarray"], gathers: list[str]):
    """ids -> Gather(t) for each name in ``gathers`` (outputs ``g_<name>``); x -> Gemm(x, E^T)."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper
    inits = [numpy_helper.from_array(a, n) for n, a in tables.items()]
    nodes = [helper.make_node("Gather", [n, "ids"], [f"g_{n}"], name=f"gather_{n}") for n in gathers]
    nodes.append(helper.make_node("Gemm", ["x", "E"], ["logits"], transB=1, name="gemm"))
    outs = [helper.make_tensor_value_info(f"g_{n}", TP.FLOAT, ["n", 64]) for n in gathers]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TP.INT64, ["n"]),
                                       helper.make_tensor_value_info("x", TP.FLOAT, ["b", 64])],
                          outs + [helper.make_tensor_value_info("logits", TP.FLOAT, ["b", 256])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _source(path: Path) -> dict[str, "np.ndarray"]:
    from safetensors.torch import load_file
    sd = load_file(path / "model.safetensors")
    return {"E": sd[EMB + ".weight"].float().numpy(), "P": sd[PL + ".weight"].float().numpy()}


@pytest.mark.parametrize("bits", [8, 4])
def test_onnx_patches_the_per_layer_gather(gemma3n, tmp_path, bits):
    """Two Gathers of same-shaped tables: each becomes a GatherBlockQuantized of its own
    overlay table (decided by source, not shape), and ONNX Runtime returns the dequantized rows."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    import numpy as np
    from embedq.backends.onnx import patch_model
    embedq.quantize(gemma3n, bits, per_layer_embeddings=True, progress=False)
    src, out = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(_onnx_graph(_source(gemma3n), ["E", "P"]), str(src))
    r = patch_model(src, gemma3n, out, accuracy_level=0)
    assert [(m.module, m.op, m.replaced) for m in r.modules] == [
        (EMB, "GatherBlockQuantized", "E"), (PL, "GatherBlockQuantized", "P"), ("lm_head", "MatMulNBits", "E")]
    assert not r.warnings, r.warnings
    assert not {"E", "P"} & {i.name for i in onnx.load(str(out)).graph.initializer}
    deq = _tables(gemma3n, torch.float32)
    ids = np.array([0, 5, 255, 7, 5], np.int64)
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    s = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got_e, got_p, logits = s.run(None, {"ids": ids, "x": x})
    np.testing.assert_array_equal(got_e, deq[EMB][ids].numpy())
    np.testing.assert_array_equal(got_p, deq[PL][ids].numpy())
    np.testing.assert_allclose(logits, x @ deq[EMB].numpy().T, rtol=1e-4, atol=1e-4)


def test_onnx_without_a_per_layer_gather_warns(gemma3n, tmp_path):
    """No Gather reads the per-layer table (only one of another table of its shape): the
    graph is patched, the per-layer table named in a warning, not an error."""
    onnx = pytest.importorskip("onnx")
    import numpy as np
    from embedq.backends.onnx import patch_model
    embedq.quantize(gemma3n, 8, per_layer_embeddings=True, progress=False)
    tables = _source(gemma3n)
    src = tmp_path / "f.onnx"
    onnx.save(_onnx_graph({"E": tables["E"]}, ["E"]), str(src))
    r = patch_model(src, gemma3n, tmp_path / "q.onnx")
    assert [m.module for m in r.modules] == [EMB, "lm_head"]
    assert any(w.startswith(PL + ": no Gather reads its float table") and "stays as it is" in w
               for w in r.warnings), r.warnings
    other = np.random.default_rng(1).standard_normal((256, 64)).astype(np.float32)
    onnx.save(_onnx_graph({"E": tables["E"], "Other": other}, ["E", "Other"]), str(src))
    r = patch_model(src, gemma3n, tmp_path / "q2.onnx")
    assert [m.replaced for m in r.modules] == ["E", "E"]
    assert any(w.startswith(PL + ":") for w in r.warnings), r.warnings
    assert any(w.startswith("Other: same shape") for w in r.warnings), r.warnings
    # the input embedding's own table is still required: a graph without it is refused
    onnx.save(_onnx_graph({"E": other, "P": tables["P"]}, ["P"]), str(src))
    with pytest.raises(EmbedqError, match=f"'P' .* is not the source of this overlay's {EMB}.weight"):
        patch_model(src, gemma3n, tmp_path / "q3.onnx")


# ------------------------------------------------------------------ GGUF

def _gguf(path: Path, out: Path, per_layer: bool) -> Path:
    """A header-level Gemma 3n GGUF: token_embd and (optionally) per_layer_token_embd, F32."""
    gguf = pytest.importorskip("gguf")
    t = _source(path)
    w = gguf.GGUFWriter(str(out), "gemma3n")
    w.add_tensor("token_embd.weight", t["E"])
    if per_layer:
        w.add_tensor("per_layer_token_embd.weight", t["P"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _mixed_bundle(path: Path, tmp_path: Path) -> Path:
    """A GGUF8 embedding and a default (int8 g64, bfloat16 scales) per-layer table: the
    per-layer scheme is the table's, so only a spliced bundle has a per-layer table GGUF
    cannot hold beside an embedding it can (the same checksums, the per-layer module's
    config and tensors from a default run)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    runs = {}
    for name, flags in (("exact", GGUF8), ("default", [])):
        runs[name] = tmp_path / name
        code, out = run_cli("quantize", path, *flags, "--per-layer-embeddings", "-o", runs[name],
                            "--overlay-only", "-q")
        assert code == 0, out
    ex, de = runs["exact"], runs["default"]
    cfg, other = (json.loads((d / "quantization_config.json").read_text()) for d in (ex, de))
    for section in ("modules", "onnx"):
        cfg[section][PL] = other[section][PL]
    (ex / "quantization_config.json").write_text(json.dumps(cfg, indent=2))
    with safe_open(ex / "embedq.safetensors", "pt") as f:
        meta = f.metadata()
    tensors = load_file(ex / "embedq.safetensors")
    tensors.update({k: v for k, v in load_file(de / "embedq.safetensors").items() if k.startswith(PL + ".")})
    save_file(tensors, ex / "embedq.safetensors", metadata=meta)
    return ex


@pytest.mark.parametrize("bits", [8, 4])
def test_gguf_transcodes_the_per_layer_table(gemma3n, tmp_path, bits):
    """An exact scheme: OUT's per_layer_token_embd (in place, BASE's order and count) is
    Q8_0/Q4_0 and gguf-py decodes it to the overlay's table bit for bit, as token_embd."""
    sys.path.insert(0, str(Path(__file__).parent / "gguf"))
    from ggufutil import assert_transcoded
    bundle = tmp_path / "bundle"
    flags = ["--bits", str(bits), "--group-size", "32", "--scale-dtype", "float16"]
    code, out = run_cli("quantize", gemma3n, *flags, "--per-layer-embeddings", "-o", bundle,
                        "--overlay-only", "-q")
    assert code == 0, out
    base = _gguf(gemma3n, tmp_path / "base.gguf", True)
    rep = embedq.gguf(base, bundle, tmp_path / "out.gguf")
    typ = {8: "Q8_0", 4: "Q4_0"}[bits]
    assert [(t.tensor, t.module, t.type_after) for t in rep.tables] == [
        ("token_embd.weight", EMB, typ), ("per_layer_token_embd.weight", PL, typ)]
    assert not any(PL in n for n in rep.notes), rep.notes
    assert_transcoded(base, rep.output, bundle, {"token_embd.weight": EMB, "per_layer_token_embd.weight": PL})


@pytest.mark.parametrize("case", ["no_table", "inexact"])
def test_gguf_leaves_the_per_layer_table_with_a_true_note(gemma3n, tmp_path, case):
    """BASE without per_layer_token_embd, or a per-layer scheme no GGUF type holds: the
    embedding is transcoded, the per-layer table left out with a note saying why, BASE's
    tensor kept byte for byte."""
    from gguf import GGUFReader
    if case == "inexact":
        bundle = _mixed_bundle(gemma3n, tmp_path)
    else:
        bundle = tmp_path / "bundle"
        code, out = run_cli("quantize", gemma3n, *GGUF8, "--per-layer-embeddings", "-o", bundle,
                            "--overlay-only", "-q")
        assert code == 0, out
    base = _gguf(gemma3n, tmp_path / "base.gguf", case == "inexact")
    rep = embedq.gguf(base, bundle, tmp_path / "out.gguf")
    assert [t.tensor for t in rep.tables] == ["token_embd.weight"]
    note = next(n for n in rep.notes if PL in n)
    if case == "inexact":
        assert note.startswith(f"module {PL} (per_layer) left out: int8 g64 sym, bfloat16 scales "
                               "(Q8_0/Q4_0 store float16): no GGUF type holds it exactly (quantize with "
                               "`--bits 8 --group-size 32 --scale-dtype float16`"), note
        assert note.endswith("; OUT keeps the base's own per_layer_token_embd.weight (F32) as it is"), note
        a, b = (next(t for t in GGUFReader(str(f)).tensors if t.name == "per_layer_token_embd.weight")
                for f in (base, rep.output))
        assert (a.tensor_type, bytes(a.data.tobytes())) == (b.tensor_type, bytes(b.data.tobytes()))
    else:
        assert note == f"module {PL} (per_layer) left out: the base has no per_layer_token_embd.weight"
    code, out = run_cli("gguf", base, "--overlay", bundle, "-o", tmp_path / "out2.gguf")
    assert code == 0 and note in out, out


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("how", ["role_on_the_embedding", "other_name"])
def test_per_layer_role_needs_a_per_layer_name(gemma3n, how):
    embedq.quantize(gemma3n, 8, per_layer_embeddings=True, progress=False)
    qf = gemma3n / "quantization_config.json"
    qc = json.loads(qf.read_text())
    if how == "role_on_the_embedding":
        qc["modules"][EMB]["role"] = "per_layer"
    else:
        qc["modules"]["model.per_layer_table"] = qc["modules"].pop(PL)
    qf.write_text(json.dumps(qc))
    with pytest.raises(OverlayError) as e:
        embedq.load_overlay(gemma3n)
    msg = str(e.value)
    assert "\n" not in msg and str(qf) in msg and "role 'per_layer'" in msg, msg
    code, out = run_cli("verify", gemma3n)
    assert_one_line_error(code, out, "quantization_config.json", "embed_tokens_per_layer")


@pytest.mark.parametrize("kind,args,needle", [
    ("qwen2", ["--per-layer-embeddings"], "no per-layer input embedding"),
    ("gemma3n", ["--per-layer-embeddings", "--format", "compressed-tensors", "-o", "{out}"],
     "drop --format compressed-tensors"),
    ("gemma3n", ["--per-layer-embeddings", "--auto"], "--max-kld/--auto"),
    ("gemma3n", ["--per-layer-embeddings", "--max-kld", "0.05"], "--max-kld/--auto"),
    ("gemma3n", ["--targets", PL + ".weight"], "--per-layer-embeddings"),
    ("gemma3n", ["--targets", f"{EMB}.weight,{PL}.weight"], "is a per-layer input embedding"),
], ids=["no-table", "compressed-tensors", "auto", "max-kld", "targets", "targets-pair"])
def test_cli_refusals_leave_the_folder_untouched(gemma3n, model_factory, tmp_path, kind, args, needle):
    path = gemma3n if kind == "gemma3n" else model_factory("qwen2_tied")
    out = tmp_path / "out"
    before = snapshot(path)
    code, text = run_cli("quantize", path, *[a.format(out=out) for a in args])
    assert_one_line_error(code, text, needle)
    assert snapshot(path) == before and not out.exists()
