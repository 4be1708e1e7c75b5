"""llama.cpp's own shape from a tied checkpoint: a 4-bit ``token_embd`` and an added 8-bit
``output.weight`` (``--head-bits 8``), written exactly; llama.cpp reads the added head."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from ckptutil import snapshot
from embedq.cli import app
from ggufutil import (FLAGS4, assert_transcoded, generate, negate_q8_0, quantize_cli, tensors,
                      write_llama_gguf)

runner = CliRunner()
HEAD8 = ["--lm-head", "--head-bits", "8", "--head-group-size", "32"]
BOTH = {"token_embd.weight": "model.embed_tokens", "output.weight": "lm_head"}
ADDED = {"output.weight": "token_embd.weight"}


def _tied(hf):
    """The tiny llama made tied: no lm_head.weight, ``tie_word_embeddings`` true."""
    from safetensors.torch import load_file, save_file
    cfg = json.loads((hf / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (hf / "config.json").write_text(json.dumps(cfg))
    for f in hf.glob("*.safetensors"):
        sd = load_file(f)
        sd.pop("lm_head.weight", None)
        save_file(sd, f, metadata={"format": "pt"})
    return hf


@pytest.fixture(scope="module")
def tied(model_factory, tmp_path_factory):
    """(tied GGUF without output.weight, overlay: 4-bit g32 table + its own 8-bit g32 head)."""
    root = tmp_path_factory.mktemp("tied-gguf")
    hf = _tied(model_factory("llama_untied_fp32"))
    base = write_llama_gguf(hf, root / "tiny-tied.gguf")
    assert "output.weight" not in tensors(base)
    return base, quantize_cli(hf, root / "q4h8", *FLAGS4, *HEAD8)


def test_tied_base_gets_an_exact_added_head(tied, tmp_path):
    base, ov = tied
    before = snapshot(base.parent)
    out = tmp_path / "out.gguf"
    res = runner.invoke(app, ["gguf", str(base), "--overlay", str(ov), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert {t["tensor"]: (t["type_before"], t["type_after"]) for t in rep["tables"]} == {
        "token_embd.weight": ("Q8_0", "Q4_0"), "output.weight": ("(added)", "Q8_0")}
    assert os.path.getsize(out) == rep["bytes_after"]
    assert_transcoded(base, out, ov, BOTH, added=ADDED)
    assert snapshot(base.parent) == before
    # inspect predicts that size before the run
    d = json.loads(runner.invoke(app, ["inspect", str(base), "--json"]).output)
    assert d["tied"] is True and d["bytes_q4_0_head_q8_0"] == rep["bytes_after"]


def test_added_head_from_another_table_is_refused(tied, model_factory, tmp_path):
    """A head made from another model's table is 'an overlay of another model'."""
    base, _ = tied
    other = quantize_cli(model_factory("llama_untied_fp32"), tmp_path / "other", *FLAGS4, *HEAD8)
    out = tmp_path / "out.gguf"
    res = runner.invoke(app, ["gguf", str(base), "--overlay", str(other), "-o", str(out)])
    assert res.exit_code != 0 and "another model" in res.output, res.output
    assert not out.exists()


def test_llamacpp_reads_the_added_head(llamacpp, tied, tmp_path):
    """OUT generates; negating the added output.weight (every block's scale sign, exactly)
    changes the greedy tokens: llama.cpp reads the added tensor, not token_embd, for the head."""
    import embedq
    base, ov = tied
    out = tmp_path / "out.gguf"
    embedq.gguf(base, ov, out)
    neg = tmp_path / "neg.gguf"
    shutil.copy(out, neg)
    negate_q8_0(neg, "output.weight")
    runs = generate(llamacpp, [out, neg], ["hello world", "abc"], 6, tmp_path)
    a, b = ([r["tokens"] for r in next(x for x in runs if x["model"] == str(m))["results"]] for m in (out, neg))
    assert all(len(t) > 0 for t in a)
    assert a != b
