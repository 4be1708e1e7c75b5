"""Issue #25: a fuzz suite over every file embedq parses.

Mutated safetensors headers (weights and overlay), shard indexes, config.json and the
overlay's quantization config (types, ties, aliases), and small ONNX graphs, driven
through ``inspect``, ``quantize``, ``verify``, ``apply``, ``remove``, ``onnx patch`` and
``embedq.load``. Every example must end in success or in one ``embedq: error:`` line
(exit 2; an :class:`EmbedqError` from the Python API), never a traceback, and leave the
source folder as it was (hashed before and after; an in-place success is removed again
and must restore it byte for byte). Example counts are bounded (the suite runs in CI
time) and printed at the end of the run (tests/security/conftest.py).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import embedq
from embedq.errors import EmbedqError
from secutil import begin, count, ends_cleanly, read_qconfig, tree, write_qconfig

def examples(*cases):
    """Each case as an explicit hypothesis example (run on top of the generated ones), so
    that every kind of mutation is tried in every run."""
    def deco(test):
        for c in reversed(cases):
            test = example(m=c)(test)
        return test
    return deco


FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
INDEX = "model.safetensors.index.json"

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 65), max_value=2 ** 65),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=10))
json_value = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=3),
                                                          st.dictionaries(st.text(max_size=6), c, max_size=3)),
                          max_leaves=5)


@pytest.fixture(scope="module")
def made(model_factory, tmp_path_factory):
    """Pristine folders, made once: float qwen2_tied, llama sharded, their in-place
    quantized copies and an overlay-only bundle of qwen2_tied."""
    root = tmp_path_factory.mktemp("fuzzsrc")
    q, l = model_factory("qwen2_tied"), model_factory("llama_untied_sharded")
    qq, lq = root / "qwen_q", root / "llama_q"
    shutil.copytree(q, qq)
    shutil.copytree(l, lq)
    embedq.quantize(qq, 8, progress=False)
    embedq.quantize(lq, 4, lm_head=True, progress=False)
    bundle = root / "bundle"
    embedq.quantize(q, 8, output=bundle, overlay_only=True, progress=False)
    return {"qwen": q, "llama": l, "qwen_q": qq, "llama_q": lq, "bundle": bundle}


def _copy(src: Path, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("fz") / src.name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _in_place(test: str, folder: Path, *extra) -> None:
    """``quantize`` in place: refused with the folder unchanged, or done, verified, and
    removed again, restoring every file."""
    before = tree(folder)
    ok, _ = ends_cleanly("quantize", folder, "-q", *extra)
    count(test, "quantize ok" if ok else "quantize refused")
    if not ok:
        assert tree(folder) == before
        return
    ends_cleanly("verify", folder)
    ok, out = ends_cleanly("remove", folder)
    assert ok, out
    assert tree(folder) == before


def _python_api(test: str, fn, *args) -> bool:
    """Success, or an :class:`EmbedqError` with a one-line message."""
    try:
        fn(*args)
    except EmbedqError as e:
        assert "\n" not in str(e), str(e)
        count(test, f"{fn.__name__} refused")
        return False
    count(test, f"{fn.__name__} ok")
    return True


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


# --- config.json and the overlay's config ----------------------------------------------------

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


# --- ONNX graphs -----------------------------------------------------------------------------

def _table(folder: Path):
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float().numpy()


def _graph(E):
    """ids -> Gather(E) -> emb; x -> MatMul(x, Transpose(E)) -> logits (a tied export)."""
    from onnx import TensorProto as TP
    from onnx import helper, numpy_helper
    V, H = E.shape
    n = helper.make_node
    nodes = [n("Gather", ["E", "ids"], ["emb"], name="gather"),
             n("Transpose", ["E"], ["Et"], perm=[1, 0], name="transpose"),
             n("MatMul", ["x", "Et"], ["logits"], name="matmul")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TP.INT64, ["n"]),
                                       helper.make_tensor_value_info("x", TP.FLOAT, ["b", H])],
                          [helper.make_tensor_value_info("emb", TP.FLOAT, ["n", H]),
                           helper.make_tensor_value_info("logits", TP.FLOAT, ["b", V])],
                          [numpy_helper.from_array(E, "E")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


ONNX_KINDS = ["drop_input", "dangling_input", "cycle", "self_loop", "dup_initializer", "dims",
              "dtype", "raw_truncated", "op_type", "drop_gather", "axis", "external",
              "external", "external", "bytes_truncated", "no_opset", "subgraph_ref"]
EXT_MUTATIONS = st.sampled_from([
    ("ok", None), ("location", "../outside.bin"), ("location", "/etc/hostname"), ("location", "a\\b.bin"),
    ("location", "C:data.bin"), ("location", ""), ("location", "missing.bin"), ("location", "sub/../data.bin"),
    ("offset", "-8"), ("offset", "abc"), ("offset", "4"), ("offset", str(2 ** 40)), ("length", "12"),
    ("length", "-1"), ("length", str(2 ** 40)), ("length", "x"), ("truncate", 100), ("truncate", 131072),
    ("link_out", None), ("drop_location", None),
])


@st.composite
def onnx_mutations(draw):
    kind = draw(st.sampled_from(ONNX_KINDS))
    if kind == "external":
        return kind, draw(EXT_MUTATIONS)
    if kind == "dims":
        return kind, draw(st.sampled_from([[512, 32], [64, 512], [512, 64, 1], [0, 64], [512], [513, 64]]))
    if kind == "dtype":
        return kind, draw(st.sampled_from([0, 2, 3, 7, 8, 9, 10, 11, 16, 40]))
    if kind == "op_type":
        return kind, draw(st.sampled_from(["Foo", "GatherElements", "Identity", "MatMulNBits"]))
    if kind == "axis":
        return kind, draw(st.sampled_from([1, -1, 5]))
    return kind, draw(st.integers(min_value=0, max_value=200))


def apply_onnx(mp, m, folder: Path, tmp: Path) -> bytes | None:
    """Mutate ``mp`` in place (writing external data into ``folder``); raw bytes for a
    mutation of the serialized model."""
    from onnx import TensorProto as TP
    from onnx import helper
    kind, v = m
    g = mp.graph
    E = g.initializer[0]
    if kind == "drop_input":
        del g.input[v % 2]
    elif kind == "dangling_input":
        g.node[2].input[0] = "nowhere"
    elif kind == "cycle":  # Et <- Transpose(logits), logits <- MatMul(x, Et)
        g.node[1].input[0] = "logits"
    elif kind == "self_loop":
        g.node[1].input[0] = "Et"
    elif kind == "dup_initializer":
        g.initializer.append(copy.deepcopy(E))
        g.initializer[-1].dims[:] = [2, 2]
        g.initializer[-1].raw_data = b"\0" * 16
    elif kind == "dims":
        E.dims[:] = v
    elif kind == "dtype":
        E.data_type = v
    elif kind == "raw_truncated":
        E.raw_data = E.raw_data[: len(E.raw_data) - 1 - v]
    elif kind == "op_type":
        g.node[0].op_type = v
    elif kind == "drop_gather":
        del g.node[0]
    elif kind == "axis":
        g.node[0].attribute.append(helper.make_attribute("axis", v))
    elif kind == "no_opset":
        del mp.opset_import[:]
    elif kind == "subgraph_ref":  # the table reached from inside an If branch
        branch = helper.make_graph([helper.make_node("Identity", ["E"], ["E2"])], "b", [],
                                   [helper.make_tensor_value_info("E2", TP.FLOAT, None)])
        g.node.insert(0, helper.make_node("If", ["cond"], ["E3"], then_branch=branch, else_branch=branch))
        g.input.append(helper.make_tensor_value_info("cond", TP.BOOL, []))
    elif kind == "external":
        what, arg = v
        raw = E.raw_data
        data = folder / "data.bin"
        data.write_bytes(raw)
        info = {"location": "data.bin", "offset": "0", "length": str(len(raw))}
        if what in ("location", "offset", "length"):
            info[what] = arg
        elif what == "truncate":
            data.write_bytes(raw[: max(0, len(raw) - arg)])
        elif what == "link_out":
            out = tmp / "outside.bin"
            data.rename(out)
            data.symlink_to(out)
        elif what == "drop_location":
            del info["location"]
        E.ClearField("raw_data")
        E.data_location = TP.EXTERNAL
        for k, val in info.items():
            e = E.external_data.add()
            e.key, e.value = k, val
    data = mp.SerializeToString()
    if kind == "bytes_truncated":
        return data[: max(1, len(data) // 2 - v)]
    return data


EVERY_ONNX_KIND = tuple((k, 0) for k in ONNX_KINDS if k not in ("external", "dims", "dtype", "op_type", "axis")) \
    + (("dims", [64, 512]), ("dims", [0, 64]), ("dtype", 10), ("dtype", 40), ("op_type", "Foo"), ("axis", 1)) \
    + tuple(("external", e) for e in EXT_MUTATIONS.elements)


@settings(FUZZ, max_examples=30)
@given(m=onnx_mutations())
@examples(*EVERY_ONNX_KIND)
def test_fuzz_onnx_patch(made, tmp_path_factory, m):
    """A mutated small ONNX graph (missing inputs, cycles, external data ...) under
    ``embedq onnx patch``: success or one line; the model's folder untouched."""
    import onnx
    t = "onnx patch"
    begin(t)
    tmp = tmp_path_factory.mktemp("ox")
    folder = tmp / "model"
    folder.mkdir()
    mp = _graph(_table(made["qwen"]))
    (folder / "model.onnx").write_bytes(apply_onnx(mp, m, folder, tmp))
    before = tree(folder)
    out = tmp / "out" / "q.onnx"
    ok, _ = ends_cleanly("onnx", "patch", folder / "model.onnx", "--overlay", made["bundle"], "--output", out)
    count(t, "patch ok" if ok else "patch refused")
    assert tree(folder) == before
    if ok:
        onnx.load(str(out))  # a readable model came out


def test_onnx_unmutated_graph_patches(made, tmp_path):
    """Positive control of the ONNX fuzz test: the unmutated graph, inline and external."""
    for m in [("dims", [512, 64]), ("external", ("ok", None))]:
        d = tmp_path / m[0]
        d.mkdir()
        mp = _graph(_table(made["qwen"]))
        (d / "model.onnx").write_bytes(apply_onnx(mp, m, d, tmp_path))
        ok, out = ends_cleanly("onnx", "patch", d / "model.onnx", "--overlay", made["bundle"],
                               "--output", d / "out" / "q.onnx")
        assert ok, out
