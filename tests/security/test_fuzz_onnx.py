"""Issue #25, ONNX graphs: a small tied export (Gather and MatMul of one table) mutated
(missing and dangling inputs, cycles, duplicate or malformed initializers, unknown ops,
an If branch reaching the table, external data pointing outside, truncated or linked out)
under ``embedq onnx patch``: success (a readable model) or one ``embedq: error:`` line,
the model's folder untouched; the unmutated graph, inline and external, is the positive
control. Its graph builders are also used by test_reads.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from secutil import FUZZ, begin, count, ends_cleanly, examples, tree


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
