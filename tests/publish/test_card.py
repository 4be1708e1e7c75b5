"""The model card of derived checkpoints and overlay bundles."""

from __future__ import annotations

import json
import shutil

import pytest
from huggingface_hub import ModelCard, ModelCardData
from typer.testing import CliRunner

import embedq
from embedq.cli import app
from embedq.jobs.card import (CardError, infer_base, read_stored, refresh_card,
                                  validate_metadata)

from pubutil import derive  # noqa: F401 (fixture)

SOURCE_CARD = """---
license: apache-2.0
language:
- en
pipeline_tag: text-generation
base_model: someone/grandparent-model
tags:
- chat
---

# The source model
"""


def _card(folder):
    card = ModelCard.load(folder / "README.md")
    return card, card.data.to_dict()


def _qconfig(folder):
    return json.loads((folder / "quantization_config.json").read_text())


def test_derived_card_front_matter_parses_and_validates(model_factory, derive):
    src = model_factory("qwen2_tied")
    (src / "README.md").write_text(SOURCE_CARD)
    _, out, report = derive("qwen2_tied", source=src, group_size=0, base_model="Qwen/Qwen2-0.5B",
                            base_revision="0123456789abcdef0123456789abcdef01234567")
    card, data = _card(out)
    assert data["base_model"] == "Qwen/Qwen2-0.5B"  # the user's, not the source card's parent
    assert data["base_model_relation"] == "quantized"
    assert data["library_name"] == "transformers"
    assert data["license"] == "apache-2.0"  # copied from the source card
    assert data["language"] == ["en"] and data["pipeline_tag"] == "text-generation"
    assert data["tags"][0] == "embedq" and "int8" in data["tags"]
    # Validates: our offline Hub rules and huggingface_hub's own card data class.
    validate_metadata(data)
    assert ModelCardData(**data).to_dict() == data
    assert isinstance(card.data, ModelCardData)
    body = card.text
    qc = _qconfig(out)
    entry = qc["modules"]["model.embed_tokens"]
    assert "int8 row sym" in body and "int8, one scale per row, symmetric" in body
    m = report.modules[0]
    assert f"{m.bytes_before:,} → {m.bytes_after:,} bytes" in body
    assert "`lm_head` reads the quantized `model.embed_tokens` table" in body  # tie handling
    assert entry["source"]["blake3"] in body  # format 2 records BLAKE3 (docs/overlay-format.md)
    assert "0123456789abcdef0123456789abcdef01234567" in body
    for section in ("### vLLM", "### transformers", "### ONNX Runtime", "embedq.load(",
                    "vllm serve", "embedq onnx export"):
        assert section in body
    assert "Not evaluated here" in body
    assert str(src) not in card.content  # no local paths published
    assert not [w for w in report.warnings if "base model" in w]


def test_untied_head_and_checkpoint_bytes(derive):
    _, out, report = derive("llama_untied_sharded", lm_head=True, head_bits=8, head_group_size=0, bits=4,
                            base_model="meta-llama/Llama-3.2-1B")
    card, data = _card(out)
    assert "4-bit" in data["tags"] and "int8" in data["tags"]
    assert "untied; the lm_head is quantized separately (`lm_head`: int8 row sym)" in card.text
    assert "Whole checkpoint (safetensors):" in card.text
    assert "`lm_head`: int8, one scale per row" in card.text
    assert "`model.embed_tokens`: 4-bit int, groups of 32" in card.text


def test_base_model_from_config_name_or_path(model_factory, derive):
    src = model_factory("llama_untied_fp32")
    cfg = json.loads((src / "config.json").read_text())
    cfg["_name_or_path"] = "acme/tiny-llama"
    (src / "config.json").write_text(json.dumps(cfg))
    _, out, report = derive("llama_untied_fp32", source=src)
    _, data = _card(out)
    assert data["base_model"] == "acme/tiny-llama"
    assert any("config.json _name_or_path" in w for w in report.warnings)


def test_local_path_name_or_path_is_not_a_base_model(model_factory, derive):
    src = model_factory("llama_untied_fp32")
    cfg = json.loads((src / "config.json").read_text())
    cfg["_name_or_path"] = str(src)
    (src / "config.json").write_text(json.dumps(cfg))
    _, out, report = derive("llama_untied_fp32", source=src)
    _, data = _card(out)
    assert "base_model" not in data and "base_model_relation" not in data
    validate_metadata(data)
    assert any("base model unknown" in w for w in report.warnings)
    assert "not recorded" in (out / "README.md").read_text()


def test_base_model_from_hf_cache_layout(model_factory, tmp_path):
    sha = "a" * 40
    snap = tmp_path / "hub" / "models--acme--tiny-qwen" / "snapshots" / sha
    shutil.copytree(model_factory("qwen2_tied"), snap)
    assert infer_base(snap) == {"base_model": "acme/tiny-qwen", "base_revision": sha,
                                "base_model_source": "Hugging Face cache path"}
    report = embedq.quantize(snap, 4, output=tmp_path / "bundle", overlay_only=True, progress=False)
    _, data = _card(tmp_path / "bundle")
    assert data["base_model"] == "acme/tiny-qwen"
    text = (tmp_path / "bundle" / "README.md").read_text()
    assert f"--revision {sha}" in text
    assert report.mode == "overlay-only"


def test_local_dir_download_metadata_gives_revision(model_factory):
    src = model_factory("qwen2_tied")
    meta = src / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    (meta / "config.json.metadata").write_text("b" * 40 + "\netag\n1700000000.0\n")
    assert infer_base(src) == {"base_revision": "b" * 40}


def test_overlay_only_bundle_card(derive):
    src, out, report = derive("qwen2_tied", bits=4, overlay_only=True, base_model="Qwen/Qwen2-0.5B",
                              base_revision="c" * 40)
    assert sorted(p.name for p in out.iterdir() if p.name != ".embedq-output") == ["README.md", "embedq.safetensors",
                                                     "quantization_config.json"]
    card, data = _card(out)
    validate_metadata(data)
    assert data["base_model"] == "Qwen/Qwen2-0.5B" and data["base_model_relation"] == "quantized"
    assert data["library_name"] == "embedq" and "overlay" in data["tags"]
    sha = _qconfig(out)["modules"]["model.embed_tokens"]["source"]["blake3"]
    assert sha in card.text
    assert "hf download Qwen/Qwen2-0.5B --revision " + "c" * 40 in card.text
    assert "embedq apply ./base --overlay ./overlay" in card.text


def test_eval_results_rendered(derive, tmp_path):
    results = {"scheme": "int8 row sym", "mean_kld": 0.0063, "same_top1": 0.962,
               "kld_percentiles": {"p50": 0.001, "p99": 0.05}, "ci95": [0.005, 0.0071],
               "contexts": 12, "per_token": list(range(100))}
    _, out, _ = derive("qwen2_tied", eval_results=results, base_model="Qwen/Qwen2-0.5B")
    text = (out / "README.md").read_text()
    assert "| mean_kld | 0.0063 |" in text
    assert "| kld_percentiles.p99 | 0.05 |" in text
    assert "| ci95 | 0.005, 0.0071 |" in text
    assert "per_token" not in text.split("<!--")[0]  # long lists are not tables
    # Eval file passed as a path, and embedq-eval.json picked up by refresh.
    f = tmp_path / "ev.json"
    f.write_text(json.dumps([{"scheme": "int4 g32 sym", "mean_kld": 0.165},
                             {"scheme": "int4 g32 asym", "mean_kld": 0.103}]))
    refresh_card(out, eval_results=f)
    text = (out / "README.md").read_text()
    assert "**int4 g32 asym**" in text and "| mean_kld | 0.103 |" in text
    (out / "embedq-eval.json").write_text(json.dumps({"mean_kld": 0.42}))
    refresh_card(out)
    assert "| mean_kld | 0.42 |" in (out / "README.md").read_text()


def test_refresh_keeps_everything_else(derive):
    _, out, _ = derive("qwen2_tied", base_model="Qwen/Qwen2-0.5B")
    before = (out / "README.md").read_text()
    assert refresh_card(out) == before  # idempotent
    refresh_card(out, repo_id="me/qwen-int8")
    after = (out / "README.md").read_text()
    assert "# qwen-int8" in after and 'hf download me/qwen-int8 --local-dir ./qwen-int8' in after
    assert 'embedq.load("./qwen-int8")' in after
    assert read_stored(after)["modules"] == read_stored(before)["modules"]
    assert ModelCard(after).data.to_dict() == ModelCard(before).data.to_dict()


def test_refresh_refuses_foreign_readme(tmp_path):
    (tmp_path / "README.md").write_text(SOURCE_CARD)
    with pytest.raises(CardError, match="not a card written by embedq"):
        refresh_card(tmp_path)


def test_report_to_model_card(derive):
    _, out, report = derive("gemma3_tied", group_size=0)
    text = report.to_model_card(base_model="google/gemma-3-270m", repo_id="me/gemma-q")
    data = ModelCard(text).data.to_dict()
    validate_metadata(data)
    assert data["base_model"] == "google/gemma-3-270m"
    assert "# gemma-q" in text and "int8 row sym" in text


def test_bad_inputs_one_line(derive, model_factory, tmp_path):
    src = model_factory("qwen2_tied")
    r = CliRunner().invoke(app, ["quantize", str(src), "--output", str(tmp_path / "o"),
                                 "--base-model", "not a repo", "-q"])
    assert r.exit_code == 2
    assert r.output.strip().count("\n") == 0 and "--base-model 'not a repo'" in r.output
    assert not (tmp_path / "o").exists()
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    r = CliRunner().invoke(app, ["quantize", str(src), "--output", str(tmp_path / "o"),
                                 "--eval", str(bad), "-q"])
    assert r.exit_code == 2 and "bad.json: not valid JSON" in r.output
    with pytest.raises(CardError, match="base_model_relation needs a base_model"):
        validate_metadata({"base_model_relation": "quantized"})
    with pytest.raises(CardError, match="not one of"):
        validate_metadata({"base_model": "a/b", "base_model_relation": "quantised"})


def test_card_cli(derive, tmp_path):
    _, out, _ = derive("qwen2_tied")
    f = tmp_path / "ev.json"
    f.write_text(json.dumps({"mean_kld": 0.001}))
    r = CliRunner().invoke(app, ["card", str(out), "--eval", str(f), "--base-model", "Qwen/Qwen2-0.5B",
                                 "--license", "apache-2.0"])
    assert r.exit_code == 0, r.output
    _, data = _card(out)
    assert data["base_model"] == "Qwen/Qwen2-0.5B" and data["license"] == "apache-2.0"
    assert "| mean_kld | 0.001 |" in (out / "README.md").read_text()


def test_other_license_link_points_at_the_base(model_factory, derive):
    src = model_factory("qwen2_tied")
    (src / "README.md").write_text("---\nlicense: other\nlicense_name: tiny-license\n"
                                   "license_link: LICENSE\n---\n# x\n")
    (src / "LICENSE").write_text("terms")
    _, out, _ = derive("qwen2_tied", source=src, overlay_only=True, base_model="acme/tiny",
                       base_revision="e" * 40)
    _, data = _card(out)
    validate_metadata(data)
    assert data["license"] == "other" and data["license_name"] == "tiny-license"
    assert data["license_link"] == "https://huggingface.co/acme/tiny/blob/" + "e" * 40 + "/LICENSE"


def test_quantize_cli_card_options(model_factory, tmp_path):
    src = model_factory("qwen2_tied")
    ev = tmp_path / "ev.json"
    ev.write_text(json.dumps({"mean_kld": 0.0063, "same_top1_pct": 96.2}))
    out = tmp_path / "q"
    r = CliRunner().invoke(app, ["quantize", str(src), "--output", str(out), "-q",
                                 "--base-model", "Qwen/Qwen2-0.5B", "--base-revision", "main",
                                 "--eval", str(ev)])
    assert r.exit_code == 0, r.output
    card, data = _card(out)
    assert data["base_model"] == "Qwen/Qwen2-0.5B"
    assert "at revision `main`" in card.text and "| same_top1_pct | 96.2 |" in card.text
    # In place there is no card: the options are reported as ignored.
    r = CliRunner().invoke(app, ["quantize", str(src), "-q", "--base-model", "Qwen/Qwen2-0.5B"])
    assert r.exit_code == 0 and "only go into the model card" in r.output


EVAL_RESULT = {  # the fields of embedq.quality.evaluate.EvalResult.to_dict()
    "path": "/home/someone/models/qwen-q", "reference": "/home/someone/models/qwen",
    "text": "pydoc_data/topics.py", "contexts": 12, "length": 128, "tokens": 1524,
    "dtype": "float32", "modules": {"model.embed_tokens": "int8 row sym", "lm_head": "int8 row sym"},
    "float_head": False, "mean_kld": 0.0063, "kld_ci95": [0.0051, 0.0075], "kld_p50": 0.002,
    "kld_p90": 0.011, "kld_p99": 0.05, "kld_max": 0.4, "same_top1": 96.2,
    "same_top1_ci95": [95.1, 97.3], "ppl_reference": 10.5, "ppl_quantized": 10.6,
    "delta_ppl": 0.1, "delta_ppl_ci95": [0.05, 0.15],
    "per_context": [{"kld": 0.006}] * 12, "seconds": 40.0, "bos": True,
    "floor_kld": 0.0007, "floor_kld_ci95": [0.00065, 0.00075], "floor_same_top1": 98.4,
    "activations": "exact",
}


def _check_eval_rendering(text):
    assert "| mean KL divergence | 0.006300 (95% CI 0.005100 – 0.007500) |" in text
    assert "| same top-1 token | 96.20% (95% CI 95.10% – 97.30%) |" in text
    assert "| perplexity | 10.5000 → 10.6000 (Δ +0.1000 (95% CI +0.0500 – +0.1500)) |" in text
    assert "12 contexts x 128 tokens (BOS first), 1,524 scored" in text
    assert "/home/someone" not in text and "per_context" not in text  # nothing local published


def test_embedq_eval_result_rendered(derive):
    _, out, _ = derive("qwen2_tied", eval_results=EVAL_RESULT, base_model="Qwen/Qwen2-0.5B")
    text = (out / "README.md").read_text()
    _check_eval_rendering(text)
    assert read_stored(text)["eval"]["path"] == "qwen-q"


def test_int8_activation_eval_says_so_on_the_card(derive):
    """A KLD measured with the int8-activation opt-in is published as such, never as exact."""
    _, out, _ = derive("qwen2_tied", eval_results=dict(EVAL_RESULT, activations="int8"))
    assert "(head with int8 activations: EMBEDQ_ACTIVATIONS=int8)" in (out / "README.md").read_text()
    _, out, _ = derive("qwen2_tied", name="exact", eval_results=EVAL_RESULT)
    assert "int8 activations" not in (out / "README.md").read_text()


def test_eval_result_object_rendered(derive):
    from embedq.quality import evaluate
    fields = set(evaluate.EvalResult.__dataclass_fields__)
    assert fields <= set(EVAL_RESULT), fields - set(EVAL_RESULT)  # the fixture above is current
    res = evaluate.EvalResult(**{k: EVAL_RESULT[k] for k in fields})
    _, out, _ = derive("qwen2_tied", eval_results=res)
    _check_eval_rendering((out / "README.md").read_text())


def test_card_names_the_overlays_format_version(derive):
    """The card states the format version the overlay was written in (2), kept across a
    refresh; a card stored before the version was kept takes it from the folder's config."""
    from embedq.format.constants import FORMAT_VERSION
    _, out, _ = derive("qwen2_tied", bits=4, overlay_only=True, base_model="Qwen/Qwen2-0.5B")
    assert _qconfig(out)["format_version"] == FORMAT_VERSION == 2
    text = (out / "README.md").read_text()
    assert "`quant_method: embedq`, format version 2)" in text and "format version 1" not in text
    r = CliRunner().invoke(app, ["card", str(out), "--stdout"])
    assert r.exit_code == 0, r.output
    assert "format version 2)" in r.output
    # an older card: its stored state has no format_version
    head, tail = text.rsplit("<!-- embedq-card ", 1)
    state, end = tail.split(" -->", 1)
    old = json.loads(state)
    del old["format_version"]
    (out / "README.md").write_text(head + "<!-- embedq-card " + json.dumps(old) + " -->" + end)
    assert "format version 2)" in refresh_card(out, write=False)
    (out / "quantization_config.json").unlink()  # nothing to take it from: no version claimed
    again = refresh_card(out, write=False)
    assert "(`quant_method: embedq`)." in again and "format version" not in again


def test_compressed_tensors_output_card_names_its_config(derive):
    """``--format compressed-tensors``: config.json holds the stock compressed-tensors config,
    so the card says so and shows vLLM without embedq's plugin (it said the embedq config was
    also in config.json and told users to install embedq for vLLM); kept across a refresh."""
    _, out, _ = derive("llama_untied_fp32", lm_head=True, format="compressed-tensors",
                       base_model="meta-llama/Llama-3.2-1B")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    for text in ((out / "README.md").read_text(), refresh_card(out, write=False)):
        assert "also in `config.json`" not in text
        assert "`config.json` holds the equivalent stock compressed-tensors config" in text
        assert "pip install vllm\n" in text and "pip install embedq vllm" not in text
    _, plain, _ = derive("llama_untied_fp32", name="plain", lm_head=True, base_model="meta-llama/Llama-3.2-1B")
    assert "also in `config.json`" in (plain / "README.md").read_text()
