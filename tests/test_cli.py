"""The CLI surface: inspect, quantize --json, verify, remove, demo, --targets."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from ckptutil import snapshot
from embedq.cli import app

runner = CliRunner()


def test_inspect_quantize_verify_remove_json(model_factory):
    path = model_factory("llama_untied_sharded")
    before = snapshot(path)
    r = runner.invoke(app, ["inspect", str(path), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["config_tie_word_embeddings"] is False and d["head_tensor"] == "lm_head.weight"
    roles = {t["role"]: t for t in d["tensors"]}
    assert roles["embedding"]["bytes"] == 1000 * 64 * 2
    assert roles["embedding"]["bytes_int8"] == 1000 * 64 + 1000 * 2 + 16
    r = runner.invoke(app, ["inspect", str(path)])
    assert r.exit_code == 0 and "MB int8" in r.stdout
    r = runner.invoke(app, ["quantize", str(path), "--bits", "4", "--lm-head", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert [m["module"] for m in rep["modules"]] == ["model.embed_tokens", "lm_head"]
    assert rep["bytes_saved"] == rep["bytes_before"] - rep["bytes_after"] > 0
    assert all(m["max_abs_error"] > 0 for m in rep["modules"])
    r = runner.invoke(app, ["verify", str(path)])
    assert r.exit_code == 0 and "overlay OK" in r.stdout
    r = runner.invoke(app, ["remove", str(path)])
    assert r.exit_code == 0
    assert snapshot(path) == before


def test_table_output(model_factory):
    path = model_factory("qwen2_tied")
    r = runner.invoke(app, ["quantize", str(path), "-q"])
    assert r.exit_code == 0, r.output
    assert "model.embed_tokens (= lm_head)" in r.stdout and "saved" in r.stdout


def test_targets_override(model_factory):
    path = model_factory("llama_untied_fp32")
    r = runner.invoke(app, ["quantize", str(path), "-q", "--json", "--targets",
                            "model.embed_tokens.weight,lm_head.weight", "--lm-head"])
    assert r.exit_code == 0, r.output
    assert [m["tensor"] for m in json.loads(r.stdout)["modules"]] == ["model.embed_tokens.weight", "lm_head.weight"]
    r = runner.invoke(app, ["quantize", str(path), "-q", "--force", "--targets", "nope.weight"])
    assert r.exit_code == 2 and "no tensor 'nope.weight'" in r.output


def test_demo(tmp_path):
    r = runner.invoke(app, ["demo", "--dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert "model.embed_tokens (= lm_head)" in r.stdout and "32768x256" in r.stdout
    assert "int8 g64 sym" in r.stdout and "warning:" not in r.output  # no warning about the default
    assert r.stdout.rstrip().splitlines()[-1] == f"demo checkpoint (kept, with its overlay): {tmp_path / 'demo-model'}"
