"""Finding the embedding Gather and the head MatMul/Gemm by graph structure."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from embedq.format.constants import is_head_name
from embedq.backends.onnx.common import OnnxError, float_types, iter_graphs, TensorRef


# ------------------------------------------------------------------ well-formedness

def check_structure(model, where) -> None:
    """Refuse a graph embedq would otherwise patch into an equally broken one: as the ONNX
    spec requires, a default-domain opset, and nodes in topological order, each input a
    graph input, an initializer, an outer-scope value or an earlier node's output (a
    missing input or a cycle fails this), every value produced once, every graph output
    produced."""
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        raise OnnxError(f"{where}: no opset_import for the default ONNX domain")
    _check_graph(model.graph, frozenset(), where)


def _check_graph(g, outer: frozenset, where) -> None:
    from onnx import AttributeProto
    given = {i.name for i in g.input} | {i.name for i in g.initializer} | \
        {s.values.name for s in g.sparse_initializer}
    names = [i.name for i in g.initializer]
    if len(set(names)) != len(names):
        dup = sorted(x for x in set(names) if names.count(x) > 1)[0]
        raise OnnxError(f"{where}: initializer {dup!r} is defined twice")
    known = set(outer) | given
    produced: set[str] = set()
    for n in g.node:
        label = n.name or n.op_type
        for x in n.input:
            if x and x not in known:
                raise OnnxError(f"{where}: node {label!r} reads {x!r}, which no graph input, initializer "
                                "or earlier node provides (a missing input, or a cycle)")
        for a in n.attribute:
            for sub in ([a.g] if a.type == AttributeProto.GRAPH else
                        list(a.graphs) if a.type == AttributeProto.GRAPHS else []):
                _check_graph(sub, frozenset(known), where)
        for o in n.output:
            if not o:
                continue
            if o in produced or o in given:
                raise OnnxError(f"{where}: value {o!r} is produced twice (node {label!r})")
            produced.add(o)
            known.add(o)
    for o in g.output:
        if o.name not in known:
            raise OnnxError(f"{where}: graph output {o.name!r} is produced by no node")


# ------------------------------------------------------------------ graph matching

@dataclass
class TableMatch:
    module: str  # overlay module whose table is used
    role: str  # embedding | head
    node: object  # NodeProto to replace
    init: str  # float initializer read
    transposed: bool  # the initializer is stored [H, V]
    via: list = field(default_factory=list)  # Identity/Transpose nodes between the two
    check: str = ""  # how the source check passed (step 2)


#: How far back a table is followed through Identity/Transpose nodes (exporters use 0-2).
MAX_HOPS = 8


class GraphIndex:
    def __init__(self, model, base_dir: Path, model_path: Path | None = None):
        self.model = model
        self.g = model.graph
        self.base_dir = base_dir
        self.model_path = model_path
        self.inits = {i.name: i for i in self.g.initializer}
        self.producer = {o: n for n in self.g.node for o in n.output}
        self._tensors: dict[str, TensorRef] = {}

    def tensor(self, name: str) -> TensorRef:
        if name not in self._tensors:
            self._tensors[name] = TensorRef(self.inits[name], self.base_dir, self.model_path)
        return self._tensors[name]

    def consumers(self, name: str) -> list:
        """Nodes (in any subgraph) that read ``name``."""
        out = []
        for g in iter_graphs(self.g):
            out.extend(n for n in g.node if name in n.input)
        return out

    def table(self, name: str, rows: int, cols: int) -> tuple[str, bool, list] | None:
        """The float initializer that ``name`` is, as a logical ``[rows, cols]`` matrix.

        Follows Identity and 2-D Transpose nodes back (the onnxruntime-genai builder feeds
        a tied model's embedding Gather from ``Transpose(perm=[1,0])`` of the head's
        ``[H, V]`` initializer; torch exporters insert Identity). Returns (initializer,
        whether it is stored ``[cols, rows]``, the nodes passed) or None.
        """
        flipped, via = False, []
        while name not in self.inits:
            n = self.producer.get(name)
            if n is None or len(via) >= MAX_HOPS or n.domain not in ("", "ai.onnx"):
                return None
            if n.op_type == "Transpose" and list(_attr(n, "perm", [1, 0])) == [1, 0]:
                flipped = not flipped
            elif n.op_type != "Identity":
                return None
            via.append(n)
            name = n.input[0]
        i = self.inits[name]
        if i.data_type not in float_types() or len(i.dims) != 2:
            return None
        # An odd number of Transposes: the initializer is stored [cols, rows].
        want = [cols, rows] if flipped else [rows, cols]
        return (name, flipped, via) if list(i.dims) == want else None

    def graph_outputs(self) -> set[str]:
        return {o.name for o in self.g.output}


def _attr(node, name: str, default=None):
    from onnx import helper
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def find_gathers(G: GraphIndex, module: str, shape: list[int]) -> list[TableMatch]:
    """Gathers (axis 0) whose data is the ``[V, H]`` table, in any stored orientation."""
    V, H = shape
    out = []
    for n in G.g.node:
        if n.op_type != "Gather" or n.domain not in ("", "ai.onnx") or _attr(n, "axis", 0) != 0:
            continue
        found = G.table(n.input[0], V, H)
        if found is not None:
            init, transposed, via = found
            out.append(TableMatch(module, "embedding", n, init, transposed, via))
    return out


def find_heads(G: GraphIndex, module: str, shape: list[int]) -> list[TableMatch]:
    """MatMul/Gemm computing ``x @ table.T`` from the ``[V, H]`` table, either orientation."""
    V, H = shape
    if V == H:  # a square table's orientation cannot be told from its shape
        return []
    out = []
    for n in G.g.node:
        if n.domain not in ("", "ai.onnx") or len(n.input) < 2:
            continue
        if n.op_type == "MatMul":
            found = G.table(n.input[1], H, V)  # B is logically [H, V]
            if found is not None:
                init, stored_vh, via = found
                out.append(TableMatch(module, "head", n, init, not stored_vh, via))
        elif n.op_type == "Gemm" and (len(n.input) == 2 or n.input[2] == ""):
            if _attr(n, "alpha", 1.0) != 1.0 or _attr(n, "transA", 0):
                continue
            if _attr(n, "transB", 0):
                found = G.table(n.input[1], V, H)
                if found is not None:
                    out.append(TableMatch(module, "head", n, found[0], found[1], found[2]))
            else:
                found = G.table(n.input[1], H, V)
                if found is not None:
                    out.append(TableMatch(module, "head", n, found[0], not found[1], found[2]))
    return out


def overlay_targets(cfg: dict) -> tuple[list[str], tuple[str, str] | None]:
    """(embedding modules, (head module, table owner) or None) of an overlay config."""
    mods = cfg["modules"]
    aliases = cfg.get("aliases") or {}
    embeddings = [m for m, e in mods.items() if e.get("role", "embedding") == "embedding"]
    head = None
    for m, e in mods.items():
        if e.get("role") == "head":
            head = (m, m)
    if head is None:
        onnx_cfg = cfg.get("onnx") or {}
        for alias, owner in aliases.items():
            if (onnx_cfg.get(alias) or {}).get("op") == "MatMulNBits" or \
                    is_head_name(alias):
                head = (alias, owner)
                break
    return embeddings, head


def optional_gathers(cfg: dict) -> list[str]:
    """Modules patched only where a Gather reads their float table (per-layer input
    embeddings, role ``per_layer``: a graph may hold them elsewhere, or not at all)."""
    return [m for m, e in cfg["modules"].items() if e.get("role") == "per_layer"]
