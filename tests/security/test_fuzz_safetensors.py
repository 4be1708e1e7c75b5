"""Issue #25, safetensors files: mutated headers of the weights (float, and the shard under an
in-place overlay) and of embedq.safetensors (in place, and in a bundle for ``apply``), and
mutated shard indexes (entries pointing outside, missing, duplicated, wrong types), driven
through ``inspect``, ``quantize`` (in place and ``--output``), ``verify``, ``remove``,
``apply`` and ``embedq.load``. Each ends in success or one ``embedq: error:`` line and
leaves the source folder as it was (secutil.py's fuzz harness); the other files embedq
parses are fuzzed in test_fuzz_config_json.py and test_fuzz_onnx.py.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

import embedq
from secutil import (FUZZ, _copy, _in_place, _python_api, begin, count, ends_cleanly, examples, json_value,
                     tree)

INDEX = "model.safetensors.index.json"


# --- safetensors headers ------------------------------------------------------------------

ST_DTYPES = ["BF16", "F16", "F32", "I8", "U8", "I32", "I64", "F64", "BOOL", "F8_E4M3", "F4"]


def split_st(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def join_st(text: bytes, body: bytes, length: int | None = None) -> bytes:
    return struct.pack("<Q", len(text) if length is None else length % 2 ** 64) + text + body


field_values = st.one_of(
    st.sampled_from(ST_DTYPES + ["X", "bf16", "", "U1"]),
    st.lists(st.integers(min_value=-3, max_value=2 ** 21), min_size=0, max_size=4),
    st.lists(st.sampled_from([0, 1, 64, 512, 2 ** 63, 2 ** 64 + 1, -1, 1.0, "8", None, True]), max_size=3),
    json_value)


@st.composite
def st_mutations(draw, names: list[str]):
    """One mutation of a safetensors file: (kind, tensor, value)."""
    kind = draw(st.sampled_from(["field", "field", "field", "shift", "reshape", "del_field",
                                 "del_entry", "add_entry", "dup_key", "trailing", "truncate",
                                 "length", "metadata", "entry", "junk"]))
    name = draw(st.sampled_from(names))
    if kind == "field" or kind == "del_field":
        return kind, name, (draw(st.sampled_from(["dtype", "shape", "data_offsets"])),
                            None if kind == "del_field" else draw(field_values))
    if kind in ("shift", "trailing", "truncate"):
        return kind, name, draw(st.integers(min_value=1, max_value=300))
    if kind == "length":
        return kind, name, draw(st.one_of(st.integers(min_value=-64, max_value=64),
                                          st.integers(min_value=0, max_value=2 ** 64)))
    if kind == "reshape":
        return kind, name, draw(st.sampled_from(["swap", "flat", "extra1", "drop"]))
    if kind == "add_entry":
        return kind, draw(st.sampled_from(names + ["extra.weight", "__metadata__x"])), draw(field_values)
    return kind, name, draw(json_value)


def apply_st(data: bytes, m) -> bytes:
    kind, name, v = m
    header, body = split_st(data)
    if kind == "trailing":
        return data + b"\0" * v
    if kind == "truncate":
        return data[:max(0, len(data) - v)]
    if kind == "junk":
        return join_st(json.dumps(v).encode() + b"\xff{", body)
    h = copy.deepcopy(header)
    e = h.get(name)
    if kind == "field":
        e[v[0]] = v[1]
    elif kind == "del_field":
        del e[v[0]]
    elif kind == "shift":
        e["data_offsets"] = [e["data_offsets"][0] + v, e["data_offsets"][1] + v]
    elif kind == "reshape":
        s = e["shape"]
        e["shape"] = {"swap": s[::-1], "flat": [math.prod(s)],
                      "extra1": s + [1], "drop": s[:-1]}[v]
    elif kind == "del_entry":
        del h[name]
    elif kind == "add_entry":
        h[name] = v
    elif kind == "metadata":
        h["__metadata__"] = v
    elif kind == "entry":
        h[name] = v
    text = json.dumps(h).encode()
    if kind == "dup_key":  # a second, different entry under the same name (JSON: last wins)
        text = text[:-1] + b", " + json.dumps(name).encode() + b": " + json.dumps(v).encode() + b"}"
    if kind == "length":
        return join_st(text, body, len(text) + v if abs(v) <= 64 else v)
    return join_st(text, body)


QWEN_NAMES = ["model.embed_tokens.weight", "model.embed_tokens.weight", "model.norm.weight",
              "model.layers.0.mlp.down_proj.weight"]
EMB = "model.embed_tokens.weight"
EVERY_ST_KIND = (
    ("field", EMB, ("dtype", "F32")), ("field", EMB, ("dtype", "X")), ("field", EMB, ("shape", [512, 65])),
    ("field", EMB, ("shape", [512, "64"])), ("field", EMB, ("data_offsets", [0, 2 ** 64])),
    ("field", EMB, ("data_offsets", [-2, 65534])), ("shift", EMB, 2), ("reshape", EMB, "swap"),
    ("reshape", EMB, "flat"), ("reshape", EMB, "extra1"), ("del_field", EMB, ("shape", None)),
    ("del_entry", EMB, None), ("del_entry", "model.norm.weight", None),
    ("add_entry", "extra.weight", {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}),
    ("dup_key", EMB, {"dtype": "BF16", "shape": [512, 64], "data_offsets": [0, 65536]}),
    ("trailing", EMB, 1), ("truncate", EMB, 1), ("length", EMB, -1), ("length", EMB, 2 ** 63),
    ("metadata", EMB, {"format": 1}), ("metadata", EMB, "pt"), ("entry", EMB, None), ("junk", EMB, None),
)


@FUZZ
@given(m=st_mutations(QWEN_NAMES))
@examples(*EVERY_ST_KIND)
def test_fuzz_weights_header(made, tmp_path_factory, m):
    """A mutated model.safetensors header: inspect, quantize (then verify, remove)."""
    t = "weights header"
    begin(t)
    f = _copy(made["qwen"], tmp_path_factory)
    p = f / "model.safetensors"
    p.write_bytes(apply_st(p.read_bytes(), m))
    before = tree(f)
    count(t, "inspect ok" if ends_cleanly("inspect", f)[0] else "inspect refused")
    assert tree(f) == before
    _in_place(t, f)


@settings(FUZZ, max_examples=30)
@given(m=st_mutations(QWEN_NAMES))
def test_fuzz_weights_header_under_an_overlay(made, tmp_path_factory, m):
    """The shard of an in-place quantized folder mutated: verify, embedq.load, remove."""
    t = "weights header, overlay in place"
    begin(t)
    f = _copy(made["qwen_q"], tmp_path_factory)
    p = f / "model.safetensors"
    p.write_bytes(apply_st(p.read_bytes(), m))
    before = tree(f)
    count(t, "verify ok" if ends_cleanly("verify", f)[0] else "verify refused")
    _python_api(t, embedq.load, f)
    assert tree(f) == before
    if ends_cleanly("remove", f)[0]:
        count(t, "remove ok")
        assert not (f / "embedq.safetensors").exists()
        assert (f / "model.safetensors").read_bytes() == p.read_bytes()


OVERLAY_NAMES = ["model.embed_tokens.weight_packed", "model.embed_tokens.weight_scale",
                 "model.embed_tokens.weight_shape"]


@settings(FUZZ, max_examples=30)
@given(m=st_mutations(OVERLAY_NAMES))
def test_fuzz_overlay_header(made, model_factory, tmp_path_factory, m):
    """A mutated embedq.safetensors: verify and embedq.load in place; apply of a bundle."""
    t = "overlay header"
    begin(t)
    f = _copy(made["qwen_q"], tmp_path_factory)
    p = f / "embedq.safetensors"
    p.write_bytes(apply_st(p.read_bytes(), m))
    before = tree(f)
    count(t, "verify ok" if ends_cleanly("verify", f)[0] else "verify refused")
    _python_api(t, embedq.load, f)
    assert tree(f) == before
    b = _copy(made["bundle"], tmp_path_factory)
    (b / "embedq.safetensors").write_bytes(p.read_bytes())
    base = _copy(made["qwen"], tmp_path_factory)
    before, bundle = tree(base), tree(b)
    ok, _ = ends_cleanly("apply", base, "--overlay", b)
    count(t, "apply ok" if ok else "apply refused")
    if ok:
        assert ends_cleanly("remove", base)[0]
    assert tree(base) == before and tree(b) == bundle


# --- shard indexes ---------------------------------------------------------------------------

LLAMA_KEYS = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
              "model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"]


# "{0}", "{1}" ... stand for the folder's shard names (filled in by apply_index).
SHARD_NAMES = ["{0}", "{1}", "{2}", "missing.safetensors", "../outside/{0}", "/tmp/{0}", "sub\\{0}",
               "C:{0}", "./{0}", "{0}/", "", ".", "embedq.safetensors", INDEX, "config.json", "sub/{0}"]


@st.composite
def index_mutations(draw):
    kind = draw(st.sampled_from(["entry", "entry", "entry", "del", "add", "dup_key", "one_shard",
                                 "weight_map", "metadata", "whole"]))
    key = draw(st.sampled_from(LLAMA_KEYS))
    value = draw(st.one_of(st.sampled_from(SHARD_NAMES), json_value))
    return kind, key, value


EVERY_INDEX_KIND = tuple(("entry", "model.embed_tokens.weight", n) for n in SHARD_NAMES) + (
    ("entry", "lm_head.weight", "../outside/{0}"), ("entry", "model.norm.weight", "/tmp/{0}"),
    ("entry", "model.embed_tokens.weight", None), ("entry", "model.embed_tokens.weight", ["{0}"]),
    ("del", "model.embed_tokens.weight", None), ("del", "model.norm.weight", None),
    ("add", "", "{1}"), ("add", "", "../x"), ("dup_key", "model.embed_tokens.weight", "../outside/{0}"),
    ("dup_key", "model.embed_tokens.weight", "{1}"), ("one_shard", "", None), ("weight_map", "", []),
    ("weight_map", "", {}), ("metadata", "", {"total_size": "x"}), ("metadata", "", None),
    ("whole", "", []), ("whole", "", None),
)


def apply_index(index: dict, m) -> bytes:
    kind, key, v = m
    shards = sorted(set(index["weight_map"].values()))
    if isinstance(v, str) and "{" in v:
        try:
            v = v.format(*shards)
        except (IndexError, KeyError, ValueError):
            pass
    ix = copy.deepcopy(index)
    wm = ix["weight_map"]
    if kind == "entry":
        wm[key] = v
    elif kind == "del":
        wm.pop(key, None)
    elif kind == "add":
        wm["model.extra_" + str(v)[:8] + ".weight"] = v
    elif kind == "one_shard":  # every tensor listed under one shard (most are not in it)
        first = sorted(set(wm.values()))[0]
        ix["weight_map"] = {k: first for k in wm}
    elif kind == "weight_map":
        ix["weight_map"] = v
    elif kind == "metadata":
        ix["metadata"] = v
    elif kind == "whole":
        return json.dumps(v).encode()
    text = json.dumps(ix).encode()
    if kind == "dup_key":
        inner = json.dumps(ix["weight_map"])
        dup = inner[:-1] + ", " + json.dumps(key) + ": " + json.dumps(v) + "}"
        text = json.dumps({**ix, "weight_map": "@"}).replace('"@"', dup).encode()
    return text


@FUZZ
@given(m=index_mutations())
@examples(*EVERY_INDEX_KIND)
def test_fuzz_index(made, tmp_path_factory, m):
    """A mutated index: inspect, quantize in place (then verify, remove), quantize --output."""
    t = "index"
    begin(t)
    f = _copy(made["llama"], tmp_path_factory)
    index = json.loads((f / INDEX).read_text())
    (f / INDEX).write_bytes(apply_index(index, m))
    before, parent = tree(f), tree(f.parent)
    count(t, "inspect ok" if ends_cleanly("inspect", f)[0] else "inspect refused")
    _in_place(t, f, "--lm-head")
    out = f.parent.parent / (f.parent.name + "-out")
    ok, _ = ends_cleanly("quantize", f, "-q", "--output", out)
    count(t, "derived ok" if ok else "derived refused")
    assert tree(f) == before
    if ok:
        assert ends_cleanly("verify", out)[0]
        shutil.rmtree(out)
    assert tree(f.parent) == parent
