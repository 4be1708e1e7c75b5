"""``patch_model``: rewrite a float graph to read the overlay's bytes."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from embedq.backends.onnx.common import (MIN_ORT, MIN_ORT_ODD_BLOCKS_4BIT, MS_DOMAIN, META_PREFIX,
                                         PROTOBUF_LIMIT, OnnxError, iter_graphs, iter_tensors, TensorRef,
                                         torch_dtype_of, tensor_proto, check_external_data,
                                         onnx_block_size, ort_scales, ort_weight_bytes, ort_zero_points,
                                         require_onnx)
from embedq.backends.onnx.genai import (GENAI_CONFIG, genai_provider, is_genai_folder,
                                        model_files, open_genai_folder, write_folder)
from embedq.backends.onnx.graph import (GraphIndex, TableMatch, check_structure, find_gathers, find_heads,
                                        optional_gathers, overlay_targets)
from embedq.backends.onnx.report import OnnxModuleReport, OnnxReport
from embedq.backends.onnx.source import check_sources
from embedq.backends.onnx.split import NodeMaker, resolve_limit, row_ranges, split_gather, split_head
from embedq.backends.onnx.write import check_not_input, check_output_file, clean_output, folder_inputs, write_model

#: MatMulNBits accuracy_level per execution provider, as onnxruntime-genai's builder picks it:
#: 4 (int8 activations) makes CPU heads 3x (int4) to 30x (int8) faster than level 0.
DEFAULT_ACCURACY_LEVEL = {"cpu": 4, "webgpu": 4}


def default_accuracy_level(execution_provider: str) -> int:
    return DEFAULT_ACCURACY_LEVEL.get(execution_provider.lower(), 0)


def load_onnx_model(path: Path):
    import onnx
    if not path.exists():
        raise OnnxError(f"{path}: no such file")
    if path.is_dir():
        raise OnnxError(f"{path}: a folder without {GENAI_CONFIG}; pass the .onnx file")
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise OnnxError(f"{path}: not a readable ONNX model ({e})") from None


def _initializer_bytes(model, base_dir: Path) -> int:
    return sum(TensorRef(i, base_dir).nbytes() for i in model.graph.initializer)


@dataclass
class _Patch:
    """What the steps of :func:`patch_model` share."""
    src_path: Path
    out_path: Path
    ov_path: Path
    cfg: dict
    mp: object  # ModelProto (no external data loaded)
    G: GraphIndex
    accuracy_level: int
    warnings: list[str] = field(default_factory=list)
    ov: object = None  # the loaded overlay (step 2)
    min_ort: str = MIN_ORT
    max_tensor_bytes: int | None = None  # split quantized tables into parts of at most this


def patch_model(model: str | os.PathLike, overlay: str | os.PathLike, output: str | os.PathLike,
                *, external_data: bool | None = None, force: bool = False,
                accuracy_level: int | None = None, execution_provider: str | None = None,
                max_tensor_bytes: int | str | None = None, target: str | None = None) -> OnnxReport:
    """Rewrite a float ONNX graph to read the overlay's quantized tables.

    ``model`` is a ``.onnx`` file, or an onnxruntime-genai folder (``genai_config.json``
    beside its model): then ``output`` is a folder, written complete (config, tokenizer
    and other files copied) so that onnxruntime_genai opens it as is.
    ``external_data``: None keeps the input's choice (and switches to external data
    when the result would not fit protobuf's 2 GB); True/False force it.
    ``accuracy_level`` of MatMulNBits: None picks the builder's per-device default for
    ``execution_provider`` (CPU 4; a genai folder's provider is read from its config).
    ``max_tensor_bytes`` (bytes, or ``"256MiB"``): a quantized table whose packed data,
    scales or zero points exceed it is split by rows into parts that fit (:mod:`.split`);
    ``target="webgpu"`` means WebGPU's default ``maxBufferSize``, 256 MiB.
    """
    require_onnx()
    limit = resolve_limit(max_tensor_bytes, target)
    if execution_provider is None and target is not None:
        execution_provider = target
    src = Path(model)
    if is_genai_folder(src):
        return _patch_genai_folder(src, Path(overlay), Path(output), external_data=external_data,
                                   force=force, accuracy_level=accuracy_level,
                                   execution_provider=execution_provider, max_tensor_bytes=limit)
    return _patch_file(src, Path(overlay), Path(output), external_data=external_data, force=force,
                       accuracy_level=accuracy_level, execution_provider=execution_provider,
                       max_tensor_bytes=limit)


def _patch_file(src_path: Path, ov_path: Path, out_path: Path, *, external_data: bool | None,
                force: bool, accuracy_level: int | None, execution_provider: str | None,
                max_tensor_bytes: int | None = None) -> OnnxReport:
    from embedq.format.reader import read_overlay_config
    t0 = time.perf_counter()
    if out_path.exists() and not force and out_path.resolve() != src_path.resolve():
        raise OnnxError(f"{out_path}: already exists (pass --force to replace it)")
    if out_path.exists() and not force:
        raise OnnxError(f"{out_path}: is the input model; pass --force to patch it in place")
    check_output_file(out_path)
    if accuracy_level is None:
        accuracy_level = default_accuracy_level(execution_provider or "cpu")
    if accuracy_level not in range(5):
        raise OnnxError(f"accuracy_level {accuracy_level}: expected 0-4 (MatMulNBits)")
    cfg = read_overlay_config(ov_path)
    mp = load_onnx_model(src_path)
    check_structure(mp, src_path)
    # Before anything is read: every external data location must stay in the model's folder.
    check_external_data(mp, src_path.parent, src_path)
    # --force replaces an earlier output, never a file this patch reads (in place, the
    # model and its data are replaced by design: see write.py)
    in_place = out_path.exists() and out_path.resolve() == src_path.resolve()
    ov_files = folder_inputs(ov_path)  # its configs and tables among them
    check_not_input(out_path, ov_files if in_place else [src_path, *_source_data(mp, src_path), *ov_files])
    if out_path.parent.is_dir():  # a killed patch's staging and stale data generation
        clean_output(out_path, src_path.parent, mp, src_path)
    P = _Patch(src_path, out_path, ov_path, cfg, mp, GraphIndex(mp, src_path.parent, src_path), accuracy_level,
               max_tensor_bytes=max_tensor_bytes)

    matches, head_modules = _find_matches(P)
    matches = check_sources(P, matches, frozenset(optional_gathers(cfg)))
    new_nodes, new_tensors, extra_inits, reports = _build_nodes(P, matches, head_modules)
    bytes_before = _initializer_bytes(mp, P.G.base_dir)
    _rewrite_graph(P, matches, new_nodes, reports)
    _record_metadata(P, reports)

    if P.min_ort == MIN_ORT_ODD_BLOCKS_4BIT:
        P.warnings.append("asymmetric 4-bit rows with an odd number of blocks: onnxruntime 1.23-1.26 "
                          f"mis-decode their zero points; use onnxruntime >= {MIN_ORT_ODD_BLOCKS_4BIT}")
    bytes_after = bytes_before - sum(r.float_bytes for r in reports) \
        + sum(a.nbytes for a in new_tensors.values()) + sum(TensorRef(i, P.G.base_dir).nbytes() for i in extra_inits)
    had_external = any(t.data_location == tensor_proto().EXTERNAL for t in iter_tensors(mp))
    if external_data is None:
        external_data = had_external or bytes_after > PROTOBUF_LIMIT * 0.9
    if not external_data and bytes_after > PROTOBUF_LIMIT * 0.95:
        raise OnnxError(f"{out_path}: {bytes_after / 1e9:.2f} GB of initializers do not fit one "
                        "protobuf file; pass --external-data")
    P.G.g.initializer.extend(extra_inits)
    largest = max([TensorRef(i, P.G.base_dir).nbytes() for i in mp.graph.initializer]
                  + [a.nbytes for a in new_tensors.values()], default=0)
    if max_tensor_bytes is not None:
        big = [i.name for i in mp.graph.initializer if TensorRef(i, P.G.base_dir).nbytes() > max_tensor_bytes]
        if big:
            P.warnings.append(f"initializers not from the overlay exceed --max-tensor-bytes "
                              f"{max_tensor_bytes}: {', '.join(big[:5])} (embedq splits only the tables "
                              "it quantizes)")
    file_bytes = write_model(mp, P.G.base_dir, out_path, new_tensors, external_data,
                             src_model=src_path, force=force)
    return OnnxReport(str(src_path), str(out_path), str(ov_path), reports, bytes_before, bytes_after,
                      file_bytes, external_data, P.min_ort, time.perf_counter() - t0, None, P.warnings,
                      accuracy_level, max_tensor_bytes, largest)


def _source_data(mp, src_path: Path) -> list[Path]:
    """The external data files the source model reads."""
    from embedq.backends.onnx.common import external_data
    return [external_data(t, src_path.parent, src_path)[0] for t in iter_tensors(mp)
            if t.data_location == tensor_proto().EXTERNAL]


def _find_matches(P: _Patch) -> tuple[list[TableMatch], dict[int, str]]:
    """Step 1: the Gathers and head MatMul/Gemm to replace, found by structure."""
    cfg, G = P.cfg, P.G
    embeddings, head = overlay_targets(cfg)
    matches: list[TableMatch] = []
    for m in embeddings:
        shape = list(cfg["modules"][m]["shape"])
        found = find_gathers(G, m, shape)
        if not found:
            already = any(n.op_type == "GatherBlockQuantized" for n in G.g.node)
            raise OnnxError(
                f"{P.src_path}: no Gather reads a float {shape} table (or a Transpose of one) for {m}"
                + (" (the graph is already patched)" if already else
                   f" (not a graph of the model in {P.ov_path}?)"))
        matches.extend(found)
    for m in optional_gathers(cfg):  # per-layer tables: patched where a Gather reads them
        shape = list(cfg["modules"][m]["shape"])
        found = find_gathers(G, m, shape)
        if not found:
            P.warnings.append(f"{m}: no Gather reads its float {shape} table; it stays as it is")
        matches.extend(found)
    head_modules: dict[int, str] = {}
    if head is not None:
        hmod, owner = head
        found = find_heads(G, owner, list(cfg["modules"][owner]["shape"]))
        if not found:
            P.warnings.append(f"{hmod}: no MatMul/Gemm with a float head table found; the head stays as it is")
        head_modules = {id(f.node): hmod for f in found}
        matches.extend(found)
    return matches, head_modules


class _Names:
    """Fresh value and node names: none the graph uses, none handed out before."""

    def __init__(self, taken):
        self.taken = set(taken)

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def release(self, names) -> None:
        self.taken.difference_update(names)


@dataclass
class _Quantized:
    """One overlay table's quantized initializers in one graph dtype, shared by every
    node that reads the table (a tied Gather and MatMulNBits)."""
    weight: str  # initializer names (of the whole table; a split table's parts have their own)
    scales: str
    zp: str
    block: int
    nb: int  # blocks per row
    bits: int
    label: str  # the scheme, for the report
    V: int
    H: int
    bytes: int = 0  # packed data + scales + zero points
    #: row parts under max_tensor_bytes, as :mod:`.split` reads them (empty: not split)
    parts: list[dict] = field(default_factory=list)
    reshape: str | None = None  # the [V, blocks, blob] view of an unsplit table (made once)
    used: bool = False  # a report row already counts its bytes

    def shape3d(self, rows: int) -> list[int]:
        """MatMulNBits reads B as [N, blocks, blob]."""
        return [rows, self.nb, self.block * self.bits // 8]


def _quantize_table(P: _Patch, module: str, gdt: torch.dtype, fresh: _Names,
                    new_tensors: dict[str, np.ndarray]) -> _Quantized:
    """The overlay's bytes for ``module`` in ONNX Runtime's layout, added to ``new_tensors``
    (by rows in parts when a tensor would exceed ``P.max_tensor_bytes``)."""
    t = P.ov.tables[module]
    block = onnx_block_size(t.bits, t.group_size, t.cols)
    nb = t.cols // block
    if t.bits == 4 and nb % 2 and not t.symmetric:
        P.min_ort = MIN_ORT_ODD_BLOCKS_4BIT
    scales = ort_scales(t, block, gdt)
    g = t.cols if t.group_size is None else t.group_size
    if not torch.equal(torch.from_numpy(scales).float(), t.scale.float().repeat_interleave(g // block, 1)):
        P.warnings.append(f"{module}: {P.cfg['modules'][module].get('scale_dtype')} scales are not "
                          f"exactly representable in the graph's {gdt}; rounded")
    base = module.replace("/", ".")
    q = _Quantized(weight=fresh(f"{base}.qweight"), scales=fresh(f"{base}.qscales"),
                   zp=fresh(f"{base}.qzero_points"), block=block, nb=nb, bits=t.bits,
                   label=P.ov.parsed.modules[module].scheme.label(), V=t.rows, H=t.cols)
    weight, zp = ort_weight_bytes(t), ort_zero_points(t, block)
    ranges = row_ranges(t.rows, max(a.nbytes // t.rows for a in (weight, scales, zp)),
                        P.max_tensor_bytes, module)
    if len(ranges) > 1:
        for k, (a, b) in enumerate(ranges):
            part = {"start": a, "stop": b, "reshape": None}
            for what, arr in (("weight", weight), ("scales", scales), ("zp", zp)):
                part[what] = fresh(f"{getattr(q, what)}.part{k}")
                new_tensors[part[what]] = arr[a:b]
            part["bytes"] = sum(new_tensors[part[w]].nbytes for w in ("weight", "scales", "zp"))
            q.parts.append(part)
        # Only the parts are written: the whole table's names go back to the pool.
        fresh.release((q.weight, q.scales, q.zp))
    else:
        new_tensors[q.weight], new_tensors[q.scales], new_tensors[q.zp] = weight, scales, zp
    q.bytes = weight.nbytes + scales.nbytes + zp.nbytes
    return q


def _build_nodes(P: _Patch, matches: list[TableMatch], head_modules: dict[int, str]):
    """Step 3: quantized initializers (one set per overlay table and graph dtype) and the
    GatherBlockQuantized / MatMulNBits nodes that replace each match."""
    import onnx
    from onnx import helper

    G = P.G
    new_tensors: dict[str, np.ndarray] = {}
    made: dict[str, _Quantized] = {}
    reports: list[OnnxModuleReport] = []
    fresh = _Names(set(G.inits) | {o for n in G.g.node for o in n.output} | {i.name for i in G.g.input})
    opset = next((o.version for o in P.mp.opset_import if o.domain in ("", "ai.onnx")), 13)
    mk = NodeMaker(fresh, opset)  # the nodes and int constants of split tables

    # MatMulNBits wants [N, blocks, blob]; a tied table keeps one 2-D initializer that a
    # Reshape views. (ORT constant-folds it, and at accuracy_level 4 also prepacks B: the
    # run-time copies are measured in docs/onnx.md.) The split and unsplit Reshapes differ
    # in their node names, the node's domain field and where their shape constant sits
    # among the initializers; they are built apart so that patched graphs stay byte-identical.
    def reshape3d(q: _Quantized, part: dict) -> str:
        """A split part's view (made once, shared by a tied gather)."""
        if part["reshape"] is None:
            shape = mk.const(f"{part['weight']}.shape3d", q.shape3d(part["stop"] - part["start"]), np.int64)
            part["reshape"] = mk.node("Reshape", [part["weight"], shape], f"{part['weight']}.3d")
        return part["reshape"]

    new_nodes: dict[int, list] = {}
    extra_inits = []  # the unsplit Reshapes' shapes, then mk's constants
    for m in matches:
        gdt = torch_dtype_of(G.tensor(m.init).elem_type)
        key = f"{m.module}/{gdt}"
        if key not in made:
            made[key] = _quantize_table(P, m.module, gdt, fresh, new_tensors)
        q = made[key]
        first_use, q.used = not q.used, True
        nm = m.node.name or m.node.output[0]
        if q.parts:
            mk.nodes = []
            if m.role == "embedding":
                split_gather(mk, q.parts, m.node.input[1], m.node.output[0], f"{nm}_embedq", q.bits, q.block)
                op = "GatherBlockQuantized"
            else:
                for part in q.parts:
                    reshape3d(q, part)
                split_head(mk, q.parts, m.node.input[0], m.node.output[0], f"{nm}_embedq", q.H,
                           q.bits, q.block, P.accuracy_level)
                op = "MatMulNBits"
            new_nodes[id(m.node)] = mk.nodes
        elif m.role == "embedding":
            node = helper.make_node(
                "GatherBlockQuantized", [q.weight, m.node.input[1], q.scales, q.zp],
                list(m.node.output), name=fresh(f"{nm}_embedq"), domain=MS_DOMAIN,
                bits=q.bits, block_size=q.block, gather_axis=0, quantize_axis=1)
            new_nodes[id(m.node)] = [node]
            op = "GatherBlockQuantized"
        else:
            pre = []
            if q.reshape is None:  # the unsplit table's view (see reshape3d for why apart)
                shape_name = fresh(f"{q.weight}.shape3d")
                extra_inits.append(onnx.numpy_helper.from_array(np.array(q.shape3d(q.V), np.int64), shape_name))
                q.reshape = fresh(f"{q.weight}.3d")
                pre = [helper.make_node("Reshape", [q.weight, shape_name], [q.reshape],
                                        name=fresh(f"{q.weight}_reshape3d"))]
            mm = helper.make_node(
                "MatMulNBits", [m.node.input[0], q.reshape, q.scales, q.zp],
                list(m.node.output), name=fresh(f"{nm}_embedq"), domain=MS_DOMAIN,
                K=q.H, N=q.V, bits=q.bits, block_size=q.block, accuracy_level=P.accuracy_level)
            new_nodes[id(m.node)] = pre + [mm]
            op = "MatMulNBits"
        module_name = head_modules.get(id(m.node), m.module) if m.role == "head" else m.module
        reports.append(OnnxModuleReport(
            module_name, m.module, op, m.node.name, m.init, q.label, q.bits, q.block,
            q.nb, m.check, 0, q.bytes if first_use else 0,
            [{"rows": [p["start"], p["stop"]], "bytes": p["bytes"]} for p in q.parts]))
    extra_inits.extend(mk.inits)
    return new_nodes, new_tensors, extra_inits, reports


def _rewrite_graph(P: _Patch, matches: list[TableMatch], new_nodes: dict[int, list],
                   reports: list[OnnxModuleReport]) -> None:
    """Step 4: splice the new nodes in place (keeps topological order), then drop the
    Identity/Transpose nodes and float initializers nothing reads any more."""
    from onnx import helper
    G = P.G
    nodes = []
    for n in G.g.node:
        nodes.extend(new_nodes.get(id(n), [n]))
    outputs = G.graph_outputs()
    via = {id(v) for m in matches for v in m.via}

    def reads(node_list) -> set[str]:
        r = {x for n in node_list for x in n.input}
        for n in node_list:
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    r |= {x for g in iter_graphs(sub) for nn in g.node for x in nn.input}
        return r

    removed_values: set[str] = set()
    while True:  # a chain Identity -> Transpose dies from its end
        read = reads(nodes)
        dead = [n for n in nodes if id(n) in via and n.output[0] not in read and n.output[0] not in outputs]
        if not dead:
            break
        removed_values |= {n.output[0] for n in dead}
        dead_ids = {id(n) for n in dead}
        nodes = [n for n in nodes if id(n) not in dead_ids]
    del G.g.node[:]
    G.g.node.extend(nodes)

    float_bytes: dict[str, int] = {}
    keep = []
    for i in G.g.initializer:
        if i.name in {m.init for m in matches}:
            still = G.consumers(i.name)
            if not still and i.name not in outputs:
                float_bytes[i.name] = G.tensor(i.name).nbytes()
                removed_values.add(i.name)
                continue
            P.warnings.append(f"{i.name}: still read by {still[0].op_type} {still[0].name!r}; "
                              "the float table stays in the graph too")
        keep.append(i)
    for r in reports:
        r.float_bytes = float_bytes.pop(r.replaced, 0)
    del G.g.initializer[:]
    G.g.initializer.extend(keep)
    for field_ in (G.g.value_info, G.g.input):
        kept = [v for v in field_ if v.name not in removed_values]
        del field_[:]
        field_.extend(kept)
    if not any(o.domain == MS_DOMAIN for o in P.mp.opset_import):
        P.mp.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))


def _record_metadata(P: _Patch, reports: list[OnnxModuleReport]) -> None:
    """Step 5: record what this graph is in ``metadata_props`` (``embedq.*``)."""
    import onnx

    from embedq.version import __version__
    from embedq.format.digest import digest_for
    cfg, mp = P.cfg, P.mp
    tables = sorted({r.table for r in reports})
    algo = digest_for(cfg["format_version"])  # the metadata key names the digest: source_blake3
    meta = {
        "version": __version__,
        "overlay_format_version": str(cfg.get("format_version")),
        "min_onnxruntime": P.min_ort,
        "accuracy_level": str(P.accuracy_level),
        "modules": json.dumps({r.module: {
            "op": r.op, "table": r.table, "scheme": r.scheme, "bits": r.bits,
            "block_size": r.block_size, "replaced": r.replaced, "source_check": r.source_check,
            f"source_{algo}": (cfg["modules"][r.table].get("source") or {}).get(algo),
            **({"accuracy_level": P.accuracy_level} if r.op == "MatMulNBits" else {}),
            **({"parts": [p["rows"] for p in r.parts]} if r.parts else {}),
        } for r in reports}, sort_keys=True),
        f"source_{algo}": json.dumps({m: (cfg["modules"][m].get("source") or {}).get(algo)
                                      for m in tables}, sort_keys=True),
        "scheme": json.dumps({m: P.ov.parsed.modules[m].scheme.label() for m in tables}, sort_keys=True),
        **({"max_tensor_bytes": str(P.max_tensor_bytes)} if P.max_tensor_bytes is not None else {}),
    }
    props = [p for p in mp.metadata_props if not p.key.startswith(META_PREFIX)]
    del mp.metadata_props[:]
    mp.metadata_props.extend(props)
    for k, v in meta.items():
        mp.metadata_props.append(onnx.StringStringEntryProto(key=META_PREFIX + k, value=v))


# ------------------------------------------------------------ onnxruntime-genai folders

def _patch_genai_folder(src: Path, ov_path: Path, out: Path, *, external_data: bool | None,
                        force: bool, accuracy_level: int | None,
                        execution_provider: str | None, max_tensor_bytes: int | None = None) -> OnnxReport:
    """Patch the decoder of an onnxruntime-genai folder into ``out``, a complete folder."""
    folder = open_genai_folder(src, out, force, overlay=ov_path)
    ep = execution_provider or genai_provider(folder.config)
    # The model's own external data files are rewritten by the patch; everything else is copied.
    own = model_files(folder, load_onnx_model(folder.model))
    kw = dict(external_data=external_data, force=force, accuracy_level=accuracy_level,
              execution_provider=ep, max_tensor_bytes=max_tensor_bytes)
    report = write_folder(folder, own, lambda decoder: _patch_file(folder.model, ov_path, decoder, **kw))
    report.model = str(src)
    report.output = str(out)
    return report
