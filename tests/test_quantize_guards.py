"""Guards of ``embedq quantize`` / ``verify`` / the Python API: what once slipped through.

Overflowing scales, non-finite numbers in ``--json``, ``--format compressed-tensors``
refusals that destroyed an earlier output or came after writing, a verify that checked
nothing, and Python values of the wrong type failing deep inside.
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import embedq
from ckptutil import snapshot
from embedq.cli import app
from embedq.errors import EmbedqError, SchemeError
from embedq.format.scheme import Scheme
from embedq.jobs.recipe import QuantizeRecipe, SchemeSearch
from embedq.jobs.report import ModuleReport, Report

runner = CliRunner()
EMB = "model.embed_tokens.weight"


def run_cli(*args):
    res = runner.invoke(app, [str(a) for a in args])
    return res.exit_code, res.stdout + (res.stderr if res.stderr_bytes is not None else "")


def assert_one_line_error(code, out, *needles):
    assert code != 0, out
    err = [ln for ln in out.splitlines() if ln.startswith("embedq: error:")]
    assert len(err) == 1, out
    for n in needles:
        assert n in err[0], err[0]
    assert "Traceback" not in out


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
