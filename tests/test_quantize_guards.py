"""Guards of ``embedq quantize`` / ``verify`` / the Python API: what once slipped through.

Overflowing scales, non-finite numbers in ``--json``, ``--format compressed-tensors``
refusals that destroyed an earlier output or came after writing, a verify that checked
nothing, Python values of the wrong type failing deep inside, head options ignored
without ``--lm-head``, shards in sub-folders of a derived output, odd ``--targets``, and a
checkpoint whose only table is saved under the head's name.
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import embedq
from ckptutil import assert_one_line_error, run_cli, snapshot
from embedq.cli import app
from embedq.errors import EmbedqError, SchemeError
from embedq.format.scheme import Scheme
from embedq.jobs.recipe import QuantizeRecipe, SchemeSearch
from embedq.jobs.report import ModuleReport, Report

runner = CliRunner()
EMB = "model.embed_tokens.weight"


def _edit_embedding(path, edit):
    f = path / "model.safetensors"
    sd = load_file(f)
    edit(sd[EMB])
    save_file(sd, f, metadata={"format": "pt"})


def _huge(model_factory, edit):
    path = model_factory("llama_untied_fp32")
    _edit_embedding(path, edit)
    return path


def test_scale_overflowing_float16_is_refused(model_factory):
    def edit(e):
        e[3, :5] = 1e7
        e[4, :3] = -1e7
    path = _huge(model_factory, edit)
    before = snapshot(path)
    code, out = run_cli("quantize", path, "--scale-dtype", "float16", "--json")
    assert_one_line_error(code, out, "model.safetensors", EMB, "row 3", "float16",
                          "--scale-dtype float32")
    assert snapshot(path) == before


def test_scale_overflowing_float32_asym_is_refused(model_factory):
    def edit(e):
        e[7, 0] = 3e38
        e[7, 1] = -3e38
    path = _huge(model_factory, edit)
    before = snapshot(path)
    code, out = run_cli("quantize", path, "--asym")
    assert_one_line_error(code, out, EMB, "row 7", "float32", "--asym")
    assert snapshot(path) == before


def _no_constants(c):
    raise AssertionError(f"invalid JSON constant {c}")


def test_json_has_no_infinity_or_nan():
    m = ModuleReport("m", "m.weight", [2, 8], "int8", "float32", 64, 16,
                     float("inf"), float("nan"), 1.0)
    text = Report("p", "in-place", [m], False).to_json()
    d = json.loads(text, parse_constant=_no_constants)
    assert d["modules"][0]["max_abs_error"] is None and d["modules"][0]["rms_error"] is None
    assert d["modules"][0]["rel_rms_error"] == 1.0


def test_json_of_overflowing_statistics_is_valid(model_factory):
    def edit(e):  # finite scales (symmetric), but the error statistics overflow float32
        e[7, 0] = 3e38
        e[7, 1] = -3e38
    path = _huge(model_factory, edit)
    r = runner.invoke(app, ["quantize", str(path), "-q", "--json"])
    assert r.exit_code == 0, r.output
    json.loads(r.stdout, parse_constant=_no_constants)


def test_ct_force_refusal_keeps_previous_output(model_factory, tmp_path):
    src = model_factory("llama_untied_fp32")
    out = tmp_path / "out"
    code, text = run_cli("quantize", src, "-o", out, "-q")
    assert code == 0, text
    old = snapshot(out)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8"}
    (src / "config.json").write_text(json.dumps(cfg))
    code, text = run_cli("quantize", src, "-o", out, "--force", "--format", "compressed-tensors", "-q")
    assert_one_line_error(code, text, "config.json", "quantization_config", "fp8")
    assert snapshot(out) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left


def test_ct_force_replaces_previous_output(model_factory, tmp_path):
    src = model_factory("llama_untied_fp32")
    out = tmp_path / "out"
    assert run_cli("quantize", src, "-o", out, "-q")[0] == 0
    r = runner.invoke(app, ["quantize", str(src), "-o", str(out), "--force", "--format",
                            "compressed-tensors", "-q", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["mode"] == "derived (compressed-tensors)"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert run_cli("verify", out)[0] == 0


def test_ct_overlay_only_refused_before_writing(model_factory, tmp_path):
    src = model_factory("llama_untied_fp32")
    out = tmp_path / "bundle"
    code, text = run_cli("quantize", src, "-o", out, "--overlay-only", "--format", "compressed-tensors")
    assert_one_line_error(code, text, "--overlay-only", "compressed-tensors")
    assert not out.exists()
    with pytest.raises(SchemeError, match="--overlay-only"):
        QuantizeRecipe(output=out, overlay_only=True, format="compressed-tensors")


def _empty_checksums(path):
    for name in ("quantization_config.json", "config.json"):
        f = path / name
        cfg = json.loads(f.read_text())
        qc = cfg.get("quantization_config", cfg)
        for m in qc["modules"].values():
            m["checksums"] = {}
        f.write_text(json.dumps(cfg))


@pytest.mark.parametrize("derived", [False, True])
def test_verify_refuses_missing_checksums(model_factory, tmp_path, derived):
    src = model_factory("llama_untied_fp32")
    path = tmp_path / "out" if derived else src
    args = ("-o", path) if derived else ()
    assert run_cli("quantize", src, *args, "-q")[0] == 0
    assert run_cli("verify", path)[0] == 0
    _empty_checksums(path)
    code, out = run_cli("verify", path)
    assert_one_line_error(code, out, "quantization_config.json", "no checksum", "weight_packed")
    assert "overlay OK" not in out


@pytest.mark.parametrize("kw, match", [
    (dict(bits=8.0), "bits 8.0: must be an integer"),
    (dict(bits=True), "bits True"),
    (dict(symmetric="no"), "symmetric 'no'"),
    (dict(group_size="32"), "group_size '32'"),
    (dict(method=1), "method 1"),
    (dict(scale_dtype=16), "scale_dtype 16"),
])
def test_scheme_types(kw, match):
    with pytest.raises(SchemeError, match=match):
        Scheme(**kw)


def test_api_types_fail_before_work(model_factory):
    path = model_factory("llama_untied_fp32")
    before = snapshot(path)
    with pytest.raises(SchemeError, match="bits 8.0"):
        embedq.quantize(path, 8.0, progress=False)
    with pytest.raises(SchemeError, match="group_size '32'"):
        embedq.quantize(path, group_size="32", progress=False)
    with pytest.raises(SchemeError, match="symmetric 'no'"):
        embedq.quantize(path, symmetric="no", progress=False)
    with pytest.raises(SchemeError, match="--max-kld 'x'"):
        embedq.quantize(path, max_kld="x", progress=False)
    with pytest.raises(TypeError, match="recipe"):
        embedq.quantize(path, recipe="x")
    with pytest.raises(EmbedqError, match="targets"):
        embedq.quantize(path, targets=[1], progress=False)
    with pytest.raises(EmbedqError, match="force"):
        embedq.quantize(path, force="yes", progress=False)
    assert snapshot(path) == before
    with pytest.raises(SchemeError, match="max-kld"):
        SchemeSearch(float("nan"))


def test_api_targets_string_is_one_name(model_factory):
    path = model_factory("llama_untied_fp32")
    assert QuantizeRecipe(targets=EMB).targets == (EMB,)
    r = embedq.quantize(path, targets=EMB, progress=False)
    assert [m.tensor for m in r.modules] == [EMB]


# --- head options, sub-folder shards, --targets ----------------------------------------------

@pytest.mark.parametrize("opts", [("--head-bits", "4"), ("--head-group-size", "32")])
def test_head_options_on_untied_model_need_lm_head(model_factory, opts):
    path = model_factory("llama_untied_fp32")
    before = snapshot(path)
    code, out = run_cli("quantize", path, *opts, "-q")
    assert_one_line_error(code, out, str(path / "config.json"), "--lm-head", opts[0])
    assert snapshot(path) == before and not (path / ".embedq").exists()
    code, out = run_cli("quantize", path, *opts, "--lm-head", "--json", "-q")
    assert code == 0, out
    assert [m["role"] for m in json.loads(out)["modules"]] == ["embedding", "head"]


def test_tied_head_bits_still_unties(model_factory):
    path = model_factory("qwen2_tied")
    r = embedq.quantize(path, 8, head_bits=4, progress=False)
    assert [m.role for m in r.modules] == ["embedding", "head"]


def _encoder(tmp_path):
    import torch
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4)
    tf.BertModel(cfg).save_pretrained(tmp_path / "bert")
    return tmp_path / "bert"


@pytest.mark.parametrize("opts", [("--lm-head",), ("--head-bits", "4")])
def test_head_options_on_model_without_head(tmp_path, opts):
    path = _encoder(tmp_path)
    before = snapshot(path)
    code, out = run_cli("quantize", path, *opts, "-q")
    assert_one_line_error(code, out, str(path / "config.json"), "no lm_head", "drop --lm-head")
    assert "unexpected" not in out
    assert snapshot(path) == before
    assert run_cli("quantize", path, "-q")[0] == 0  # the embedding alone still quantizes


def _move_shards(path, sub, shards):
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    (path / sub).mkdir(parents=True)
    for f in shards:
        (path / f).rename(path / sub / f)
    index["weight_map"] = {k: f"{sub}/{v}" if v in shards else v for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))


@pytest.mark.parametrize("moved", ["embedding", "other", "both"])
def test_derived_output_of_shards_in_sub_folders(model_factory, tmp_path, moved):
    src = model_factory("llama_untied_sharded")
    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    emb_shard = wm[EMB]
    assert list(wm.values()).count(emb_shard) == 1  # the shard holds only the embedding
    other = next(v for v in sorted(set(wm.values())) if v not in (emb_shard, wm["lm_head.weight"]))
    shards = {"embedding": [emb_shard], "other": [other], "both": [emb_shard, other]}[moved]
    _move_shards(src, "a/b", shards)
    out = tmp_path / "out"
    code, text = run_cli("quantize", src, "-o", out, "-q")
    assert code == 0, text
    out_index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for name, f in out_index.items():
        assert (out / f).is_file(), (name, f)
    assert EMB not in out_index
    dirs = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_dir())
    assert dirs == ([] if moved == "embedding" else ["a", "a/b"])  # no empty folder left
    assert (out / "a/b" / other).is_file() == (moved != "embedding")
    assert run_cli("verify", out)[0] == 0


TARGET_CASES = [
    ("", "an empty name"),
    (f"{EMB},", "an empty name"),
    ("model.embed_tokens", f"did you mean {EMB}?"),
    ("lm_head.weight", "is the output embedding"),
    (f"lm_head.weight,{EMB}", "the input embedding comes first"),
    (f"{EMB},{EMB}", f"names {EMB} twice"),
    (f"{EMB},lm_head.weight,lm_head.weight", "3 names"),
    ("model.norm.weight", "not an input or output embedding"),
]


@pytest.mark.parametrize("targets, problem", TARGET_CASES)
def test_odd_targets_one_clear_line(model_factory, targets, problem):
    path = model_factory("llama_untied_fp32")
    before = snapshot(path)
    code, out = run_cli("quantize", path, "--targets", targets, "--lm-head", "-q")
    assert_one_line_error(code, out, str(path), problem)
    if "did you mean" not in problem:
        assert f"--targets {EMB}[,lm_head.weight]" in out  # what to pass
    assert snapshot(path) == before and not (path / ".embedq").exists()


def test_targets_with_spaces_work(model_factory):
    path = model_factory("llama_untied_fp32")
    code, out = run_cli("quantize", path, "--targets", f" {EMB} , lm_head.weight ", "--lm-head", "--json", "-q")
    assert code == 0, out
    assert [m["tensor"] for m in json.loads(out)["modules"]] == [EMB, "lm_head.weight"]


@pytest.mark.parametrize("value", ["1GiB", "-5"])
def test_bad_compile_min_bytes_is_one_line_before_writing(model_factory, monkeypatch, value):
    path = model_factory("llama_untied_fp32")
    before = snapshot(path)
    monkeypatch.setenv("EMBEDQ_COMPILE_MIN_BYTES", value)
    code, out = run_cli("quantize", path)
    assert_one_line_error(code, out, "EMBEDQ_COMPILE_MIN_BYTES", repr(value), "unset it")
    assert snapshot(path) == before


@pytest.mark.parametrize("extra", [(), ("--targets", "lm_head.weight"), ("--lm-head",)])
def test_only_a_head_named_table_says_so(model_factory, tmp_path, extra):
    """A tied table saved only as ``lm_head.weight``: one line saying the checkpoint stores no
    input embedding and how to get one (was "found no embedding tensors ()" and, with
    --targets, "is the output embedding ... the input embedding comes first")."""
    path = tmp_path / "m"
    shutil.copytree(model_factory("qwen2_tied"), path)
    sd = load_file(path / "model.safetensors")
    sd["lm_head.weight"] = sd.pop(EMB)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    before = snapshot(path)
    code, out = run_cli("quantize", path, "-q", *extra)
    assert_one_line_error(code, out, str(path), "stores no input embedding, only the head lm_head.weight",
                          "save_pretrained")
    assert snapshot(path) == before and not (path / ".embedq").exists()
