"""Issue #25, the model's config: mutated config.json fields embedq reads (ties, vocab and
hidden sizes, architectures, quantization_config ...) of float folders through ``inspect``
and ``quantize`` and of in-place quantized ones through ``verify``, ``embedq.load`` and
``remove``; and the overlay config's ties and aliases, in quantization_config.json and/or
config.json's copy, through those and ``apply`` of a bundle. Each ends in success or one
``embedq: error:`` line and leaves the source folder as it was (secutil.py's fuzz
harness); test_fuzz_config.py checks the ranges of quantization_config.json's fields.
"""

from __future__ import annotations

import copy
import json

from hypothesis import given, settings
from hypothesis import strategies as st

import embedq
from secutil import (FUZZ, _copy, _in_place, _python_api, begin, count, ends_cleanly, json_value, read_qconfig,
                     tree, write_qconfig)

CONFIG_KEYS = ["tie_word_embeddings", "vocab_size", "hidden_size", "architectures", "model_type",
               "text_config", "quantization_config", "torch_dtype", "num_hidden_layers",
               "_name_or_path", "bos_token_id"]
config_values = st.one_of(st.sampled_from([True, False, None, "yes", 0, 1, 512, 511, 513, 64, 1000, -1,
                                           2 ** 40, 1.5, "512", [], {}, ["Qwen2ForCausalLM"],
                                           ["NoSuchModel"], "qwen2", "llama", "bfloat16", "float64",
                                           {"quant_method": "embedq"}, {"quant_method": "gptq"},
                                           {"vocab_size": 512, "tie_word_embeddings": False}]),
                          json_value)


@st.composite
def config_mutations(draw):
    return draw(st.sampled_from(CONFIG_KEYS)), draw(st.booleans()) and draw(st.booleans()), draw(config_values)


def apply_config(cfg: dict, m) -> dict:
    key, delete, v = m
    cfg = copy.deepcopy(cfg)
    if delete:
        cfg.pop(key, None)
    else:
        cfg[key] = v
    return cfg


@FUZZ
@given(m=config_mutations(), which=st.sampled_from(["qwen", "llama"]))
def test_fuzz_config_json(made, tmp_path_factory, m, which):
    """A mutated config.json of a float folder: inspect, quantize (then verify, remove)."""
    t = "config.json"
    begin(t)
    f = _copy(made[which], tmp_path_factory)
    (f / "config.json").write_text(json.dumps(apply_config(json.loads((f / "config.json").read_text()), m)))
    before = tree(f)
    count(t, "inspect ok" if ends_cleanly("inspect", f)[0] else "inspect refused")
    assert tree(f) == before
    _in_place(t, f, *(["--lm-head"] if which == "llama" else []))


@settings(FUZZ, max_examples=30)
@given(m=config_mutations())
def test_fuzz_config_json_under_an_overlay(made, tmp_path_factory, m):
    """config.json of an in-place quantized folder mutated (its quantization_config, ties):
    verify, embedq.load, remove."""
    t = "config.json, overlay in place"
    begin(t)
    f = _copy(made["qwen_q"], tmp_path_factory)
    (f / "config.json").write_text(json.dumps(apply_config(json.loads((f / "config.json").read_text()), m)))
    before = tree(f)
    count(t, "verify ok" if ends_cleanly("verify", f)[0] else "verify refused")
    _python_api(t, embedq.load, f)
    assert tree(f) == before
    count(t, "remove ok" if ends_cleanly("remove", f)[0] else "remove refused")


TIES = st.sampled_from([
    ("tie_word_embeddings", True), ("tie_word_embeddings", False), ("tie_word_embeddings", "true"),
    ("aliases", {}), ("aliases", {"lm_head": "model.embed_tokens"}), ("aliases", {"model.embed_tokens": "lm_head"}),
    ("aliases", {"lm_head": "model.embed_tokens", "model.lm_head": "model.embed_tokens"}),
    ("aliases", {"lm_head": "lm_head"}), ("aliases", {"model.norm": "model.embed_tokens"}),
    ("aliases", ["lm_head"]), ("aliases", None), ("aliases", {"lm_head": None}),
])


@settings(FUZZ, max_examples=30)
@given(tie=TIES, where=st.sampled_from(["both", "file", "config.json"]),
       drop_file=st.booleans())
def test_fuzz_ties_and_aliases(made, model_factory, tmp_path_factory, tie, where, drop_file):
    """Ties and aliases of the overlay config, in quantization_config.json and/or config.json's
    copy (read when the file is gone): verify, embedq.load, apply of a bundle, remove."""
    t = "ties and aliases"
    begin(t)
    key, value = tie
    f = _copy(made["qwen_q"], tmp_path_factory)
    cfg = read_qconfig(f)
    cfg[key] = value
    if where in ("both", "file"):
        (f / "quantization_config.json").write_text(json.dumps(cfg))
    if where in ("both", "config.json"):
        c = json.loads((f / "config.json").read_text())
        c["quantization_config"] = cfg
        (f / "config.json").write_text(json.dumps(c))
    if drop_file:
        (f / "quantization_config.json").unlink()
    before = tree(f)
    count(t, "verify ok" if ends_cleanly("verify", f)[0] else "verify refused")
    _python_api(t, embedq.load, f)
    assert tree(f) == before
    count(t, "remove ok" if ends_cleanly("remove", f)[0] else "remove refused")
    b = _copy(made["bundle"], tmp_path_factory)
    bc = read_qconfig(b)
    bc[key] = value
    write_qconfig(b, bc)
    base = _copy(made["qwen"], tmp_path_factory)
    before = tree(base)
    ok, _ = ends_cleanly("apply", base, "--overlay", b)
    count(t, "apply ok" if ok else "apply refused")
    if ok:
        assert ends_cleanly("verify", base)[0] and ends_cleanly("remove", base)[0]
    assert tree(base) == before
