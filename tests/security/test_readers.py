"""docs/security.md rows 0 and 15, rule by rule: every parsed file is checked once, in its
reader, and a file breaking a rule is one ``embedq: error:`` line naming it and the rule.
safetensors headers (bounded, held to the file's size, safetensors' own rules), also for
the shards before transformers opens them (``check_weights``); config.json's fields embedq
reads, by type (``check_config``); ONNX initializers' data against their dims (inline, typed,
external). The fuzz suites (test_fuzz_*.py) show that no mutation ends in a traceback; these
pin each rule, so a check that goes missing fails here even where a later reader would
have accepted the file.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest

import embedq
from embedq.errors import EmbedqError
from embedq.format.constants import MAX_HEADER_BYTES
from secutil import assert_refused, run_cli, tree

EMB = "model.embed_tokens.weight"


def _split(raw: bytes):
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header: dict, body: bytes) -> bytes:
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb + body


def _first(h: dict) -> str:
    return min((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])


def _field(key, value, name=EMB):
    def f(h, body):
        h[name][key] = value
        return h, body
    return f


def _shift(h, body):
    """The first tensor starts 2 bytes late (sizes right, data one tensor longer)."""
    b, e = h[_first(h)]["data_offsets"]
    h[_first(h)]["data_offsets"] = [b + 2, e + 2]
    return h, body


def _overlap(h, body):
    """The last tensor's bytes declared on top of the first one's (sizes right)."""
    last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    b, e = h[last]["data_offsets"]
    h[last]["data_offsets"] = [0, e - b]
    return h, body


def _giant(h, body):
    """A declared shape of 2^46 elements, offsets to match: refused against the file's size,
    never allocated or mapped."""
    end = max(v["data_offsets"][1] for k, v in h.items() if k != "__metadata__")
    h["model.huge.weight"] = {"dtype": "BF16", "shape": [2 ** 40, 64], "data_offsets": [end, end + 2 ** 47]}
    return h, body


HEADER_RULES = {  # name: (edit, words of the error)
    "unknown dtype": (_field("dtype", "X"), ("dtype 'X' is not a safetensors dtype",)),
    "dtype spelled otherwise": (_field("dtype", "bf16"), ("is not a safetensors dtype",)),
    "negative size": (_field("shape", [-1, 64]), ("is not a list of sizes",)),
    "size not an int": (_field("shape", [512, 64.0]), ("is not a list of sizes",)),
    "offsets reversed": (_field("data_offsets", [10, 5]), ("are not [begin, end]",)),
    "offsets not ints": (_field("data_offsets", [0, "8"]), ("are not [begin, end]",)),
    "offsets hold other bytes": (_field("shape", [512, 65]), ("needs 66560 bytes, data_offsets hold 65536",)),
    "not from 0 / gapped": (_shift, ("expected 0: overlapping or gapped",)),
    "overlapping": (_overlap, ("overlapping or gapped",)),
    "trailing bytes": (lambda h, body: (h, body + b"\0" * 8), ("trailing bytes after the tensors",)),
    "cut short": (lambda h, body: (h, body[:-8]), ("truncated safetensors file",)),
    "metadata not strings": (lambda h, body: ({**h, "__metadata__": {"format": 1}}, body),
                             ("__metadata__ must map names to strings",)),
    "giant shape": (_giant, ("truncated safetensors file",)),
}


@pytest.fixture
def qwen(model_factory):
    return model_factory("qwen2_tied")


@pytest.mark.parametrize("rule", sorted(HEADER_RULES))
def test_safetensors_header_rule(qwen, rule):
    """A header breaking one of safetensors' rules: refused by ``inspect`` (which reads
    nothing but headers) and ``quantize``, naming the file and the rule; nothing written."""
    edit, words = HEADER_RULES[rule]
    f = qwen / "model.safetensors"
    f.write_bytes(_join(*edit(*_split(f.read_bytes()))))
    before = tree(qwen)
    assert_refused(run_cli("inspect", qwen), str(f), *words)
    assert_refused(run_cli("quantize", qwen, "-q"), str(f), *words)
    assert tree(qwen) == before


@pytest.mark.parametrize("length", ["past the file", "past the bound"])
def test_safetensors_header_length_is_bounded(qwen, length):
    """The header's declared length is held to the file's size and to safetensors' own bound
    (100 MiB) before a byte of it is read: a file larger than the bound (sparse here) whose
    header claims more than it is refused without reading 100 MiB of it."""
    f = qwen / "model.safetensors"
    raw = f.read_bytes()
    if length == "past the file":
        f.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
        n = len(raw)
    else:
        n = MAX_HEADER_BYTES + 8
        with open(f, "wb") as h:
            h.write(struct.pack("<Q", n) + b"{")
            h.truncate(MAX_HEADER_BYTES + 4096)  # a hole: no disk used
    assert_refused(run_cli("inspect", qwen), str(f), f"corrupt safetensors header (length {n})")


def test_shards_are_checked_before_transformers_opens_them(model_factory):
    """``embedq.load`` hands the folder to transformers, which opens every shard: their
    headers are checked first, so a broken one is embedq's one error, not transformers'."""
    q = model_factory("qwen2_tied")
    embedq.quantize(q, 8, progress=False)
    f = q / "model.safetensors"
    h, body = _split(f.read_bytes())
    h["__metadata__"] = {"format": "pt", "note": 1}
    f.write_bytes(_join(h, body))
    with pytest.raises(EmbedqError, match=f"{f}: corrupt safetensors header .__metadata__ must map"):
        embedq.load(q)


# --- config.json: the fields embedq reads, by type (check_config) ------------------------------

@pytest.mark.parametrize("key,value,want", [
    ("tie_word_embeddings", "yes", "expected true or false"),
    ("vocab_size", "512", "expected a non-negative integer"),
    ("vocab_size", -1, "expected a non-negative integer"),
    ("vocab_size", True, "expected a non-negative integer"),
    ("hidden_size", 64.0, "expected a non-negative integer"),
    ("num_hidden_layers", -2, "expected a non-negative integer"),
    ("architectures", "Qwen2ForCausalLM", "expected a list of class names"),
    ("architectures", [7], "expected a list of class names"),
    ("model_type", 7, "expected a string"),
    ("text_config", [], "expected an object"),
    ("quantization_config", "x", "expected an object"),
    ("text_config.vocab_size", "x", "expected a non-negative integer"),
])
def test_config_json_fields_by_type(qwen, key, value, want):
    cfg = json.loads((qwen / "config.json").read_text())
    if key.startswith("text_config."):
        cfg["text_config"] = {key.split(".")[1]: value}
    else:
        cfg[key] = value
    (qwen / "config.json").write_text(json.dumps(cfg))
    before = tree(qwen)
    line = assert_refused(run_cli("inspect", qwen), str(qwen / "config.json"), f"{key} is ", want)
    assert_refused(run_cli("quantize", qwen, "-q"), str(qwen / "config.json"), f"{key} is ", want)
    assert tree(qwen) == before and line


# --- ONNX initializers: data against dims (backends/onnx/common.TensorRef) ---------------------

@pytest.fixture(scope="module")
def onnx_inputs(model_factory, tmp_path_factory):
    pytest.importorskip("onnx")
    from test_fuzz_onnx import _table
    q = model_factory("qwen2_tied")
    bundle = tmp_path_factory.mktemp("ob") / "bundle"
    embedq.quantize(q, 8, output=bundle, overlay_only=True, progress=False)
    return _table(q), bundle


def _raw_short(E, folder):
    E.raw_data = E.raw_data[:-4]


def _typed_short(E, folder):
    import numpy as np
    values = np.frombuffer(E.raw_data, dtype=np.float32)
    E.ClearField("raw_data")
    E.float_data.extend(values[:-1].tolist())


def _external(length_delta, cut=0):
    def f(E, folder):
        from onnx import TensorProto as TP
        raw = E.raw_data
        (folder / "data.bin").write_bytes(raw[:len(raw) - cut])
        E.ClearField("raw_data")
        E.data_location = TP.EXTERNAL
        for k, v in (("location", "data.bin"), ("offset", "0"), ("length", str(len(raw) + length_delta))):
            e = E.external_data.add()
            e.key, e.value = k, v
    return f


ONNX_RULES = {
    "inline raw data short": (_raw_short, "raw_data holds 131068 bytes, dims [512, 64] need 131072"),
    "typed data short": (_typed_short, "values do not fit dims [512, 64]"),
    "external length not the size": (_external(-4), "length 131068) does not hold its 131072 bytes"),
    "external file short": (_external(0, cut=4), "does not hold its 131072 bytes (file 131068 bytes)"),
}


@pytest.mark.parametrize("rule", sorted(ONNX_RULES))
def test_onnx_initializer_data_against_its_dims(onnx_inputs, tmp_path, rule):
    from test_fuzz_onnx import _graph
    table, bundle = onnx_inputs
    edit, words = ONNX_RULES[rule]
    folder = tmp_path / "model"
    folder.mkdir()
    mp = _graph(table)
    edit(mp.graph.initializer[0], folder)
    (folder / "model.onnx").write_bytes(mp.SerializeToString())
    before = tree(folder)
    out = tmp_path / "out" / "q.onnx"
    assert_refused(run_cli("onnx", "patch", folder / "model.onnx", "--overlay", bundle, "--output", out),
                   str(folder / "model.onnx"), "initializer 'E'", words)
    assert tree(folder) == before and not out.exists()


def test_onnx_genuine_initializers_patch(onnx_inputs, tmp_path):
    """The positive control: the same graph, inline and external, patches."""
    from test_fuzz_onnx import _graph
    table, bundle = onnx_inputs
    for name, edit in (("inline", None), ("external", _external(0))):
        folder = tmp_path / name
        folder.mkdir()
        mp = _graph(table)
        if edit:
            edit(mp.graph.initializer[0], folder)
        (folder / "model.onnx").write_bytes(mp.SerializeToString())
        code, out, exc = run_cli("onnx", "patch", folder / "model.onnx", "--overlay", bundle, "--output",
                                 folder / "out" / "q.onnx")
        assert code == 0, (out, exc)
    assert os.path.getsize(tmp_path / "inline" / "out" / "q.onnx") > 0
    shutil.rmtree(tmp_path / "inline" / "out")
