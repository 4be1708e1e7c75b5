"""Fuzzing ``quantization_config.json`` (issue #12, item 6): for ``verify``, ``apply`` and
``embedq.load`` a mutated config is either refused with an :class:`EmbedqError` or is
one whose every field is in range. Never another exception, never an accepted
out-of-range value. Example counts are modest: the test machine is slow.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import embedq
from embedq.errors import EmbedqError
from secutil import read_qconfig, tree, write_qconfig

SHAPE = [512, 64]  # qwen2_tied's embedding
MOD = "model.embed_tokens"

ENTRY_FIELDS = ("num_bits", "type", "symmetric", "strategy", "group_size", "scale_dtype", "method",
                "role", "shape", "source", "checksums")
SOURCE_FIELDS = ("tensor", "dtype", "blake3", "sha256")
TOP_FIELDS = ("quant_method", "format_version", "overlay", "modules", "tie_word_embeddings",
              "aliases", "base_quantization_config", "onnx")

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 64), max_value=2 ** 64),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_value = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=3),
                                                          st.dictionaries(st.text(max_size=8), c, max_size=3)),
                          max_leaves=6)
plausible = st.sampled_from([
    4, 8, 16, 32, 64, 128, 2 ** 31, 2 ** 40, -8, 0, 1, True, False, "8", 8.0, None,
    "int", "float", "channel", "group", "bfloat16", "float16", "float32", "float64",
    "rtn", "mse", "gptq", "embedding", "head", "mtp", "lm_head",
    [512, 64], [64, 512], [512, 32], [1024, 64], [512.0, 64.0], [512], [0, 64], [2 ** 40, 2 ** 40],
    "model.embed_tokens", "model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight",
    "../model.safetensors", "/etc/passwd", "0" * 64, "embedq", 1.5, {"lm_head": "model.embed_tokens"},
    {"lm_head": "x"}, {}, [],
])
values = st.one_of(plausible, json_value)


@st.composite
def mutations(draw):
    """(where, key, value-or-DELETE) applied to a valid config."""
    where = draw(st.sampled_from(["entry", "entry", "entry", "source", "top"]))
    fields = {"entry": ENTRY_FIELDS, "source": SOURCE_FIELDS, "top": TOP_FIELDS}[where]
    key = draw(st.sampled_from(fields))
    delete = draw(st.booleans()) and draw(st.booleans())
    return where, key, None if delete else draw(values), delete


def mutate(cfg: dict, m) -> dict:
    where, key, value, delete = m
    cfg = copy.deepcopy(cfg)
    d = {"top": cfg, "entry": cfg["modules"][MOD], "source": cfg["modules"][MOD]["source"]}[where]
    if delete:
        d.pop(key, None)
    else:
        d[key] = value
    return cfg


def in_range(cfg: dict) -> None:
    """What an accepted config must satisfy (an oracle independent of embedq.format.config)."""
    assert isinstance(cfg, dict)
    assert cfg["quant_method"] == "embedq"
    assert type(cfg["format_version"]) is int and cfg["format_version"] in (1, 2)
    algo = {1: "sha256", 2: "blake3"}[cfg["format_version"]]
    assert cfg.get("overlay", "embedq.safetensors") == "embedq.safetensors"
    assert isinstance(cfg.get("tie_word_embeddings", False), bool)
    mods = cfg["modules"]
    assert isinstance(mods, dict) and set(mods) == {MOD}
    e = mods[MOD]
    assert type(e["num_bits"]) is int and e["num_bits"] in (4, 8)
    assert e.get("type", "int") == "int"
    assert isinstance(e["symmetric"], bool)
    g = e.get("group_size")
    assert g is None or (type(g) is int and g >= 8 and g % 8 == 0 and SHAPE[1] % g == 0)
    assert e.get("strategy", "channel" if g is None else "group") == ("channel" if g is None else "group")
    assert e.get("scale_dtype", "bfloat16") in ("bfloat16", "float16", "float32")
    assert e.get("method", "rtn") in ("rtn", "mse", "gptq")
    assert e.get("role", "embedding") in ("embedding", "mtp")
    assert e["shape"] == SHAPE and all(type(x) is int for x in e["shape"])
    src = e["source"]
    assert isinstance(src, dict) and src["tensor"] == MOD + ".weight"
    assert src.get("dtype") in (None, "bfloat16", "float16", "float32")
    sha = src.get(algo)
    assert sha is None or (isinstance(sha, str) and len(sha) == 64)
    assert ({"sha256", "blake3"} - {algo}).isdisjoint(src)  # the other version's digest
    ck = e.get("checksums") or {}
    assert isinstance(ck, dict) and all(k.startswith(MOD + ".weight_") for k in ck)
    aliases = cfg.get("aliases") or {}
    assert isinstance(aliases, dict) and all(v == MOD for v in aliases.values())
    assert set(aliases) <= {"lm_head", "model.lm_head"}
    base = cfg.get("base_quantization_config")
    assert base is None or (isinstance(base, dict) and base.get("quant_method") != "embedq")


FUZZ = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def made(model_factory, tmp_path_factory):
    src = model_factory("qwen2_tied")
    bundle = tmp_path_factory.mktemp("fz") / "bundle"
    embedq.quantize(src, 8, output=bundle, overlay_only=True, progress=False)
    embedq.quantize(src, 8, progress=False)
    return src, bundle, read_qconfig(src)


def _outcome(fn, cfg):
    """Run ``fn``; an EmbedqError is a refusal, success must mean an in-range config."""
    try:
        fn()
    except EmbedqError as e:
        assert "\n" not in str(e)
        event("refused")
        return False
    in_range(cfg)
    event("accepted")
    return True


@FUZZ
@given(m=mutations())
def test_fuzz_verify(made, tmp_path_factory, m):
    src, _, good = made
    folder = tmp_path_factory.mktemp("v") / "m"
    shutil.copytree(src, folder, symlinks=True)
    cfg = mutate(good, m)
    write_qconfig(folder, cfg)
    _outcome(lambda: embedq.verify(folder), cfg)


@FUZZ
@given(m=mutations())
def test_fuzz_load_overlay(made, tmp_path_factory, m):
    src, _, good = made
    folder = tmp_path_factory.mktemp("l") / "m"
    shutil.copytree(src, folder, symlinks=True)
    cfg = mutate(good, m)
    write_qconfig(folder, cfg)
    _outcome(lambda: embedq.load_overlay(folder), cfg)


@settings(FUZZ, max_examples=12)
@given(m=mutations())
def test_fuzz_apply(made, model_factory, tmp_path_factory, m):
    _, bundle, _ = made
    b = tmp_path_factory.mktemp("a") / "bundle"
    shutil.copytree(bundle, b)
    cfg = mutate(read_qconfig(bundle), m)
    (b / "quantization_config.json").write_text(json.dumps(cfg))
    base = model_factory("qwen2_tied")
    before = tree(base)
    if _outcome(lambda: embedq.apply(base, b), cfg):
        embedq.remove(base)
    assert tree(base) == before


def test_genuine_config_is_accepted_everywhere(made, tmp_path):
    """The positive control of the fuzz tests below."""
    src, bundle, good = made
    in_range(good)
    embedq.verify(src)
    embedq.load_overlay(src)
    model = embedq.load(src)
    assert type(model.get_input_embeddings()).__name__ == "QuantizedEmbedding"


@settings(FUZZ, max_examples=10)
@given(m=mutations())
def test_fuzz_embedq_load(made, tmp_path_factory, m):
    src, _, good = made
    folder = tmp_path_factory.mktemp("t") / "m"
    shutil.copytree(src, folder, symlinks=True)
    cfg = mutate(good, m)
    write_qconfig(folder, cfg)
    _outcome(lambda: embedq.load(folder), cfg)


@settings(FUZZ, max_examples=15)
@given(v=json_value)
def test_fuzz_whole_config_is_any_json(made, tmp_path_factory, v):
    src, _, _ = made
    folder = tmp_path_factory.mktemp("j") / "m"
    shutil.copytree(src, folder, symlinks=True)
    (folder / "quantization_config.json").write_text(json.dumps(v))
    with pytest.raises(EmbedqError):
        embedq.verify(folder)
    with pytest.raises(EmbedqError):
        embedq.load_overlay(folder)
