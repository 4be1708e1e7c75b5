"""ONNX Runtime back end: the overlay's bytes as ``GatherBlockQuantized`` and ``MatMulNBits``.

``weight_packed`` (int32, compressed-tensors ``pack-quantized``) viewed as little-endian
bytes *is* the uint8 table ONNX Runtime's ``com.microsoft`` block-quantized operators read
(overlay contract §1), so no value is re-quantized here. What this module does:

* finds, by graph structure (not by name), the ``Gather`` that reads the float token
  embedding and the ``MatMul``/``Gemm`` that computes the logits from the head table;
* checks that each float initializer is the overlay's source table (sha256 of the rows
  as the source dtype, or, where the graph dtype cannot hold the source exactly, sampled
  rows within quantization error) and refuses otherwise;
* replaces them with ``GatherBlockQuantized`` and ``MatMulNBits`` reading one shared uint8
  initializer (tied models: ``MatMulNBits`` reads it through a ``Reshape``);
* expresses per-row scales as a block scale repeated over the largest power-of-two
  block dividing the row, converts scales to the graph's float32/float16, always emits
  zero points, repacking asymmetric ones from compressed-tensors' layout (packed along
  rows, signed) to ONNX Runtime's (packed along blocks, unsigned, low nibble first);
* streams external data (initializers are copied or memory-mapped, never all loaded);
* records what it did in ``metadata_props``.

``export_model`` exports a transformers causal LM with ``torch.onnx.export(dynamo=True)``
and patches the result in one step.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from embedq.errors import EmbedqError
from embedq.format.constants import QUANT_METHOD, is_head_name

MS_DOMAIN = "com.microsoft"
#: GatherBlockQuantized on uint8 data needs onnxruntime >= 1.23 (1.20-1.22 reject uint8);
#: 1.23-1.26 mis-decode 4-bit zero points of rows with an odd number of blocks (exact for
#: symmetric tables thanks to midpoint padding, see ort_zero_points; asymmetric need 1.27).
MIN_ORT = "1.23"
MIN_ORT_ODD_BLOCKS_4BIT = "1.27"
MIN_BLOCK = 16
ALIGN = 4096  # external data offsets of big tensors: page-aligned so runtimes can mmap them
SMALL_TENSOR = 1 << 16  # smaller ones are 64-byte aligned
PROTOBUF_LIMIT = 2_000_000_000
CHUNK_BYTES = 16 << 20
SAMPLE_ROWS = 512
META_PREFIX = "embedq."


class OnnxError(EmbedqError):
    """An ONNX graph cannot be exported or patched with this overlay."""


# --------------------------------------------------------------------------- dtypes

def _tp():
    from onnx import TensorProto
    return TensorProto


def _np_dtype(elem_type: int) -> np.dtype:
    TP = _tp()
    table = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16, TP.BFLOAT16: np.uint16,
             TP.DOUBLE: np.float64, TP.INT64: np.int64, TP.INT32: np.int32, TP.INT8: np.int8,
             TP.UINT8: np.uint8, TP.INT16: np.int16, TP.UINT16: np.uint16, TP.BOOL: np.bool_}
    try:
        return np.dtype(table[elem_type])
    except KeyError:
        raise OnnxError(f"unsupported initializer data type {elem_type}") from None


def _torch_dtype(elem_type: int) -> torch.dtype:
    TP = _tp()
    return {TP.FLOAT: torch.float32, TP.FLOAT16: torch.float16, TP.BFLOAT16: torch.bfloat16}[elem_type]


def _float_types() -> set[int]:
    TP = _tp()
    return {TP.FLOAT, TP.FLOAT16, TP.BFLOAT16}


# ------------------------------------------------------------------ block layout

def onnx_block_size(bits: int, group_size: int | None, cols: int) -> int:
    """ONNX Runtime block size for a table: the largest power of two dividing its group.

    A group (or, per-row, the whole row) becomes ``group/block`` blocks that repeat
    its scale and zero point. Raises :class:`OnnxError` when that block is < 16.
    """
    g = cols if group_size is None else group_size
    block = g & -g
    if block < MIN_BLOCK:
        what = f"rows of {cols}" if group_size is None else f"group size {group_size}"
        raise OnnxError(f"{what}: ONNX Runtime needs a power-of-two block >= {MIN_BLOCK} "
                        f"dividing it (largest is {block}); re-quantize with --group-size 32")
    return block


def ort_scales(table, block: int, dtype: torch.dtype) -> np.ndarray:
    """Scales ``[rows, cols/block]`` in ``dtype`` (float32/float16), groups repeated."""
    g = table.cols if table.group_size is None else table.group_size
    s = table.scale.to(torch.float32)
    if g // block > 1:
        s = s.repeat_interleave(g // block, dim=1)
    return s.to(dtype).contiguous().numpy()


def ort_zero_points(table, block: int) -> np.ndarray:
    """Zero points in ONNX Runtime's layout: uint8 ``[rows, ceil(nb*bits/8)]``.

    compressed-tensors stores signed zero points packed along rows (dim 0) into
    int32; ONNX Runtime wants unsigned zero points ``zp + 2^(bits-1)`` packed along
    blocks (dim 1), element 0 in the low nibble, rows padded to whole bytes.
    Symmetric tables get the explicit midpoint (0x88 / 128).
    """
    from embedq.format.codec import pack_bytes
    bits, rows, cols = table.bits, table.rows, table.cols
    g = cols if table.group_size is None else table.group_size
    nb = cols // block
    mid = 1 << (bits - 1)
    if table.zero_point is None:
        u = torch.full((rows, nb), mid, dtype=torch.uint8)
    else:
        u = (table.zero_point.to(torch.int16) + mid).to(torch.uint8)
        if g // block > 1:
            u = u.repeat_interleave(g // block, dim=1)
    if bits == 4 and nb % 2:
        # The padding nibble is the midpoint, not 0: onnxruntime 1.23-1.26 read 4-bit
        # zero points as one unpadded nibble stream, so with this padding symmetric
        # tables still decode exactly there (asymmetric ones need >= 1.27).
        u = torch.nn.functional.pad(u, (0, 1), value=mid)
    return pack_bytes(u.contiguous(), bits).numpy()


def ort_weight_bytes(table) -> np.ndarray:
    """``weight_packed`` as ONNX Runtime's uint8 table ``[rows, cols*bits/8]`` (no copy)."""
    return table.packed.contiguous().view(torch.uint8).numpy()


# ---------------------------------------------------------------- initializer access

class _Tensor:
    """Lazy access to an initializer's values: inline raw data, typed fields or external."""

    def __init__(self, proto, base_dir: Path):
        self.proto = proto
        self.base_dir = base_dir
        self._arr: np.ndarray | None = None

    @property
    def dims(self) -> list[int]:
        return list(self.proto.dims)

    @property
    def elem_type(self) -> int:
        return self.proto.data_type

    @property
    def external(self) -> bool:
        return self.proto.data_location == _tp().EXTERNAL

    def array(self) -> np.ndarray:
        """The values as an array (memory-mapped for external data; bf16 as uint16)."""
        if self._arr is not None:
            return self._arr
        dt = _np_dtype(self.elem_type)
        shape = tuple(self.dims)
        if self.external:
            info = {e.key: e.value for e in self.proto.external_data}
            path = self.base_dir / info["location"]
            if not path.exists():
                raise OnnxError(f"{path}: external data of initializer {self.proto.name!r} is missing")
            off = int(info.get("offset", 0))
            self._arr = np.memmap(path, dtype=dt, mode="r", offset=off, shape=shape)
        elif self.proto.HasField("raw_data"):
            self._arr = np.frombuffer(self.proto.raw_data, dtype=dt).reshape(shape)
        else:
            from onnx import numpy_helper
            a = numpy_helper.to_array(self.proto)
            self._arr = a.view(np.uint16) if self.elem_type == _tp().BFLOAT16 else a
        return self._arr

    def rows(self, a: int, b: int, transposed: bool) -> torch.Tensor:
        """Rows ``a:b`` of the logical ``[V, H]`` table (``transposed``: stored ``[H, V]``)."""
        arr = self.array()
        chunk = np.array(arr[:, a:b].T if transposed else arr[a:b], order="C", copy=True)
        if self.elem_type == _tp().BFLOAT16:
            return torch.from_numpy(chunk.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(chunk)

    def nbytes(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n * _np_dtype(self.elem_type).itemsize


def _iter_graphs(graph) -> Iterator:
    """The graph and every subgraph (If/Loop/Scan bodies)."""
    from onnx import AttributeProto
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                yield from _iter_graphs(attr.g)
            elif attr.type == AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _iter_graphs(g)


def _iter_tensors(model) -> Iterator:
    """Every TensorProto that can carry (external) data: initializers and attributes."""
    from onnx import AttributeProto
    for g in _iter_graphs(model.graph):
        yield from g.initializer
        for s in g.sparse_initializer:
            yield s.values
            yield s.indices
        for node in g.node:
            for attr in node.attribute:
                if attr.type == AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == AttributeProto.TENSORS:
                    yield from attr.tensors


# ------------------------------------------------------------------- source checks

@dataclass
class SourceCheck:
    how: str  # sha256 | dequantized | sampled-rows
    detail: str = ""


def _lossless(graph_dtype: torch.dtype, src_dtype: torch.dtype) -> bool:
    """Can ``graph_dtype`` represent every value of ``src_dtype``?"""
    return graph_dtype == src_dtype or graph_dtype == torch.float32


def _chunk_rows(cols: int) -> int:
    return max(64, CHUNK_BYTES // max(1, cols * 4))


def check_source(t: _Tensor, transposed: bool, entry: dict, table, where: str) -> SourceCheck:
    """Is the float initializer ``t`` the overlay's source table? Raise OnnxError if not.

    1. sha256 of the rows cast to the source dtype equals the recorded source sha256
       (only possible where the graph dtype holds the source values exactly);
    2. or every row equals the dequantized overlay table (a graph built from it);
    3. or, where the graph dtype cannot hold the source exactly (float16 graph of a
       bfloat16 source), sampled rows lie within half a quantization step (plus the
       graph dtype's rounding) of the dequantized rows.
    """
    from embedq.format.dtypes import dtype_from_name
    src = entry.get("source") or {}
    rows, cols = entry["shape"]
    gdt = _torch_dtype(t.elem_type)
    sdt = dtype_from_name(src.get("dtype", "bfloat16"))
    lossless = _lossless(gdt, sdt)
    cr = _chunk_rows(cols)
    if src.get("sha256"):
        h = hashlib.sha256()
        for a in range(0, rows, cr):
            h.update(t.rows(a, min(rows, a + cr), transposed).to(sdt).contiguous().view(torch.uint8).numpy())
        if h.hexdigest() == src["sha256"]:
            return SourceCheck("sha256")
    # A graph exported from the dequantized table (a derived checkpoint has no float source).
    sample = _sample_rows(rows)
    x = torch.cat([t.rows(int(r), int(r) + 1, transposed) for r in sample])
    deq = table.dequantize(torch.float32, sample).to(gdt)
    if torch.equal(x, deq):
        for a in range(0, rows, cr):
            b = min(rows, a + cr)
            if not torch.equal(t.rows(a, b, transposed), table.dequantize(torch.float32, slice(a, b)).to(gdt)):
                break
        else:
            return SourceCheck("dequantized")
    if not lossless:
        ok, frac = _within_quantization_error(x, table, sample, gdt)
        if ok:
            return SourceCheck("sampled-rows", f"{len(sample)} rows, {frac:.4%} of values within "
                               "half a quantization step (graph dtype cannot hold the source exactly)")
    raise OnnxError(
        f"{where} is not the source of this overlay's {src.get('tensor', 'table')} "
        f"(sha256 of its {rows}x{cols} values differs from quantization_config.json"
        f"{'' if lossless else ', and sampled rows are not within quantization error'}); "
        "refusing to patch with a wrong or stale overlay")


def _sample_rows(rows: int) -> torch.Tensor:
    n = min(rows, SAMPLE_ROWS)
    return torch.unique(torch.linspace(0, rows - 1, n).round().long())


def _within_quantization_error(x: torch.Tensor, table, sample: torch.Tensor,
                               gdt: torch.dtype) -> tuple[bool, float]:
    q = table.codes(sample).float()
    g = table.cols if table.group_size is None else table.group_size
    s = table.scale[sample].float().repeat_interleave(g, dim=1)
    deq = table.dequantize(torch.float32, sample)
    xf = x.float()
    eps = torch.finfo(gdt).eps
    tol = 0.5 * s * (1 + 1e-3) + eps * xf.abs() + torch.finfo(gdt).tiny
    d = xf - deq
    lo, hi = -(1 << (table.bits - 1)), (1 << (table.bits - 1)) - 1
    ok = d.abs() <= tol
    ok |= (q == hi) & (d >= -tol)  # a clipped maximum may lie further out
    ok |= (q == lo) & (d <= tol)
    frac = float(ok.float().mean())
    return frac >= 0.999 and bool(torch.isfinite(xf).all()), frac


# ------------------------------------------------------------------ graph matching

@dataclass
class _Match:
    module: str  # overlay module whose table is used
    role: str  # embedding | head
    node: object  # NodeProto to replace
    init: str  # float initializer read
    transposed: bool  # head stored [H, V] (no Transpose node)
    transpose_node: object | None = None


class _Graph:
    def __init__(self, model, base_dir: Path):
        self.model = model
        self.g = model.graph
        self.base_dir = base_dir
        self.inits = {i.name: i for i in self.g.initializer}
        self.producer = {o: n for n in self.g.node for o in n.output}
        self._tensors: dict[str, _Tensor] = {}

    def tensor(self, name: str) -> _Tensor:
        if name not in self._tensors:
            self._tensors[name] = _Tensor(self.inits[name], self.base_dir)
        return self._tensors[name]

    def consumers(self, name: str) -> list:
        """Nodes (in any subgraph) that read ``name``."""
        out = []
        for g in _iter_graphs(self.g):
            out.extend(n for n in g.node if name in n.input)
        return out

    def resolve_init(self, name: str) -> str | None:
        """The initializer behind ``name``, looking through Identity nodes."""
        seen = 0
        while name not in self.inits:
            n = self.producer.get(name)
            if n is None or n.op_type != "Identity" or seen > 8:
                return None
            name, seen = n.input[0], seen + 1
        return name

    def float_init(self, name: str, dims: list[int]) -> bool:
        i = self.inits.get(name)
        return i is not None and list(i.dims) == dims and i.data_type in _float_types()

    def graph_outputs(self) -> set[str]:
        return {o.name for o in self.g.output}


def _attr(node, name: str, default=None):
    from onnx import helper
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _find_gathers(G: _Graph, module: str, shape: list[int]) -> list[_Match]:
    out = []
    for n in G.g.node:
        if n.op_type != "Gather" or n.domain not in ("", "ai.onnx"):
            continue
        if _attr(n, "axis", 0) != 0:
            continue
        init = G.resolve_init(n.input[0])
        if init is not None and G.float_init(init, shape):
            out.append(_Match(module, "embedding", n, init, False))
    return out


def _find_heads(G: _Graph, module: str, shape: list[int]) -> list[_Match]:
    V, H = shape
    out = []
    for n in G.g.node:
        if n.domain not in ("", "ai.onnx"):
            continue
        if n.op_type == "MatMul":
            b = n.input[1]
            init = G.resolve_init(b)
            if init is not None and G.float_init(init, [H, V]) and V != H:
                out.append(_Match(module, "head", n, init, True))
                continue
            tn = G.producer.get(b)
            if tn is not None and tn.op_type == "Transpose" and list(_attr(tn, "perm", [1, 0])) == [1, 0]:
                init = G.resolve_init(tn.input[0])
                if init is not None and G.float_init(init, [V, H]):
                    out.append(_Match(module, "head", n, init, False, tn))
        elif n.op_type == "Gemm" and (len(n.input) == 2 or n.input[2] == ""):
            if _attr(n, "alpha", 1.0) != 1.0 or _attr(n, "transA", 0):
                continue
            init = G.resolve_init(n.input[1])
            if init is None:
                continue
            if _attr(n, "transB", 0) and G.float_init(init, [V, H]):
                out.append(_Match(module, "head", n, init, False))
            elif not _attr(n, "transB", 0) and G.float_init(init, [H, V]) and V != H:
                out.append(_Match(module, "head", n, init, True))
    return out


def _overlay_targets(cfg: dict) -> tuple[list[str], tuple[str, str] | None]:
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


# ---------------------------------------------------------------------- the report

@dataclass
class OnnxModuleReport:
    module: str
    table: str  # overlay module owning the bytes
    op: str
    node: str
    replaced: str  # float initializer replaced
    scheme: str
    bits: int
    block_size: int
    blocks_per_row: int
    source_check: str
    float_bytes: int
    quantized_bytes: int  # 0 when the bytes are shared with another module


@dataclass
class OnnxReport:
    model: str
    output: str
    overlay: str
    modules: list[OnnxModuleReport]
    initializer_bytes_before: int
    initializer_bytes_after: int
    file_bytes: int
    external_data: bool
    min_onnxruntime: str
    seconds: float = 0.0
    export_seconds: float | None = None
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        def mb(n: int) -> str:
            return f"{n / 2**20:.2f} MiB"
        lines = [f"{self.output}  (from {self.model}, overlay {self.overlay})"]
        for m in self.modules:
            q = "shared" if m.quantized_bytes == 0 else mb(m.quantized_bytes)
            lines.append(f"  {m.module:<28} {m.op:<21} {m.scheme:<14} block {m.block_size:<4} "
                         f"{mb(m.float_bytes):>12} -> {q:>12}  source: {m.source_check}")
        lines.append(f"  initializers {mb(self.initializer_bytes_before)} -> "
                     f"{mb(self.initializer_bytes_after)}; file(s) {mb(self.file_bytes)}"
                     f"{' (external data)' if self.external_data else ''}; "
                     f"needs onnxruntime >= {self.min_onnxruntime}")
        t = f"{self.seconds:.1f}s" if self.export_seconds is None else \
            f"{self.seconds:.1f}s (export {self.export_seconds:.1f}s)"
        lines.append(f"  done in {t}")
        lines.extend(f"  warning: {w}" for w in self.warnings)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# --------------------------------------------------------------------------- patch

def _load_model(path: Path):
    import onnx
    if not path.exists():
        raise OnnxError(f"{path}: no such file")
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise OnnxError(f"{path}: not a readable ONNX model ({e})") from None


def _initializer_bytes(model, base_dir: Path) -> int:
    return sum(_Tensor(i, base_dir).nbytes() for i in model.graph.initializer)


def patch_model(model: str | os.PathLike, overlay: str | os.PathLike, output: str | os.PathLike,
                *, external_data: bool | None = None, force: bool = False) -> OnnxReport:
    """Rewrite a float ONNX graph to read the overlay's quantized tables.

    ``external_data``: None keeps the input's choice (and switches to external data
    when the result would not fit protobuf's 2 GB); True/False force it.
    """
    import onnx
    from onnx import helper

    from embedq.version import __version__
    from embedq.format.config import scheme_of
    from embedq.format.reader import load_overlay, read_overlay_config

    t0 = time.perf_counter()
    src_path, out_path, ov_path = Path(model), Path(output), Path(overlay)
    if out_path.exists() and not force and out_path.resolve() != src_path.resolve():
        raise OnnxError(f"{out_path}: already exists (pass --force to replace it)")
    if out_path.exists() and not force:
        raise OnnxError(f"{out_path}: is the input model; pass --force to patch it in place")
    cfg = read_overlay_config(ov_path)
    mp = _load_model(src_path)
    G = _Graph(mp, src_path.parent)
    embeddings, head = _overlay_targets(cfg)
    warnings: list[str] = []

    # 1. find what to replace, by structure
    matches: list[_Match] = []
    for m in embeddings:
        found = _find_gathers(G, m, list(cfg["modules"][m]["shape"]))
        if not found:
            already = any(n.op_type == "GatherBlockQuantized" for n in G.g.node)
            raise OnnxError(
                f"{src_path}: no Gather reads a float {cfg['modules'][m]['shape']} table for {m}"
                + (" (the graph is already patched)" if already else
                   f" (not a graph of the model in {ov_path}?)"))
        matches.extend(found)
    if head is not None:
        hmod, owner = head
        found = _find_heads(G, owner, list(cfg["modules"][owner]["shape"]))
        if not found:
            warnings.append(f"{hmod}: no MatMul/Gemm with a float head table found; the head stays as it is")
        for f in found:
            f.role = "head"
        hmods = {id(f.node): hmod for f in found}
        matches.extend(found)
    else:
        hmods = {}

    # 2. check every float initializer against the overlay's source (once per initializer)
    ov = load_overlay(ov_path)
    checks: dict[tuple[str, bool], SourceCheck | None] = {}
    failed: dict[str, list[str]] = {}
    for m in matches:
        key = (m.init, m.transposed)
        if key in checks:
            continue
        entry = cfg["modules"][m.module]
        where = (f"{src_path}: initializer {m.init!r} ({m.node.op_type} {m.node.name!r})")
        if G.tensor(m.init).elem_type == _tp().BFLOAT16:
            raise OnnxError(f"{where} is bfloat16; ONNX Runtime's CPU kernels take float32 or "
                            "float16 scales and outputs: export the model in float32 or float16")
        try:
            checks[key] = check_source(G.tensor(m.init), m.transposed, entry, ov.tables[m.module], where)
        except OnnxError:
            # Several candidates of the right shape (e.g. a second [V, H] table): keep
            # those that are the source; refuse only if none of a role is.
            if not any(x.role == m.role and x.init != m.init for x in matches):
                raise
            checks[key] = None
            failed.setdefault(m.role, []).append(m.init)
            continue
        if checks[key].how == "sampled-rows":
            warnings.append(f"{m.init}: {checks[key].detail}")
    for role, inits in failed.items():
        if not any(checks[(x.init, x.transposed)] for x in matches if x.role == role):
            raise OnnxError(f"{src_path}: none of the float [V, H] tables {sorted(set(inits))} read by a "
                            f"{'Gather' if role == 'embedding' else 'MatMul'} is the source of this "
                            "overlay; refusing to patch with a wrong or stale overlay")
        warnings.append(f"{', '.join(sorted(set(inits)))}: same shape but not the overlay's source; left as is")
    matches = [x for x in matches if checks[(x.init, x.transposed)] is not None]

    # 3. build the quantized initializers (one set per overlay table and graph dtype)
    new_tensors: dict[str, np.ndarray] = {}
    made: dict[str, dict] = {}
    reports: list[OnnxModuleReport] = []
    used_names = set(G.inits) | {o for n in G.g.node for o in n.output} | {i.name for i in G.g.input}

    def fresh(base: str) -> str:
        name, k = base, 1
        while name in used_names:
            name, k = f"{base}_{k}", k + 1
        used_names.add(name)
        return name

    min_ort = MIN_ORT

    def quantized(module: str, gdt: torch.dtype) -> dict:
        nonlocal min_ort
        key = f"{module}/{gdt}"
        if key in made:
            return made[key]
        t = ov.tables[module]
        s = scheme_of(cfg["modules"][module])
        block = onnx_block_size(t.bits, t.group_size, t.cols)
        nb = t.cols // block
        if t.bits == 4 and nb % 2 and not t.symmetric:
            min_ort = MIN_ORT_ODD_BLOCKS_4BIT
        scales = ort_scales(t, block, gdt)
        if not torch.equal(torch.from_numpy(scales).float(),
                           t.scale.float().repeat_interleave((t.cols if t.group_size is None else t.group_size) // block, 1)):
            warnings.append(f"{module}: {cfg['modules'][module].get('scale_dtype')} scales are not "
                            f"exactly representable in the graph's {gdt}; rounded")
        base = module.replace("/", ".")
        d = {"weight": fresh(f"{base}.qweight"), "scales": fresh(f"{base}.qscales"),
             "zp": fresh(f"{base}.qzero_points"), "block": block, "nb": nb, "bits": t.bits,
             "label": s.label(), "reshape": None, "V": t.rows, "H": t.cols}
        new_tensors[d["weight"]] = ort_weight_bytes(t)
        new_tensors[d["scales"]] = scales
        new_tensors[d["zp"]] = ort_zero_points(t, block)
        d["bytes"] = sum(new_tensors[d[k]].nbytes for k in ("weight", "scales", "zp"))
        made[key] = d
        return d

    new_nodes: dict[int, list] = {}
    extra_inits = []
    for m in matches:
        init_t = G.tensor(m.init)
        gdt = _torch_dtype(init_t.elem_type)
        q = quantized(m.module, gdt)
        first_use = q.get("used") is None
        q["used"] = True
        nm = m.node.name or m.node.output[0]
        if m.role == "embedding":
            node = helper.make_node(
                "GatherBlockQuantized", [q["weight"], m.node.input[1], q["scales"], q["zp"]],
                list(m.node.output), name=fresh(f"{nm}_embedq"), domain=MS_DOMAIN,
                bits=q["bits"], block_size=q["block"], gather_axis=0, quantize_axis=1)
            new_nodes[id(m.node)] = [node]
            op = "GatherBlockQuantized"
        else:
            if q["reshape"] is None:
                shape_name = fresh(f"{q['weight']}.shape3d")
                extra_inits.append(onnx.numpy_helper.from_array(
                    np.array([q["V"], q["nb"], q["block"] * q["bits"] // 8], np.int64), shape_name))
                q["reshape"] = fresh(f"{q['weight']}.3d")
                reshape = helper.make_node("Reshape", [q["weight"], shape_name], [q["reshape"]],
                                           name=fresh(f"{q['weight']}_reshape3d"))
                pre = [reshape]
            else:
                pre = []
            mm = helper.make_node(
                "MatMulNBits", [m.node.input[0], q["reshape"], q["scales"], q["zp"]],
                list(m.node.output), name=fresh(f"{nm}_embedq"), domain=MS_DOMAIN,
                K=q["H"], N=q["V"], bits=q["bits"], block_size=q["block"])
            new_nodes[id(m.node)] = pre + [mm]
            op = "MatMulNBits"
        module_name = hmods.get(id(m.node), m.module) if m.role == "head" else m.module
        reports.append(OnnxModuleReport(
            module_name, m.module, op, m.node.name, m.init, q["label"], q["bits"], q["block"],
            q["nb"], checks[(m.init, m.transposed)].how, 0, q["bytes"] if first_use else 0))

    # 4. rewrite the node list in place (keeps topological order); drop dead Transposes
    replaced_inits = {m.init for m in matches}
    transposes = {id(m.transpose_node) for m in matches if m.transpose_node is not None}
    nodes = []
    for n in G.g.node:
        nodes.extend(new_nodes.get(id(n), [n]))
    outputs = G.graph_outputs()
    read = {x for n in nodes for x in n.input}
    for n in nodes:
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                read |= {x for g in _iter_graphs(sub) for nn in g.node for x in nn.input}
    removed_values = set()
    kept_nodes = []
    for n in nodes:
        if id(n) in transposes and n.output[0] not in read and n.output[0] not in outputs:
            removed_values.add(n.output[0])
            continue
        kept_nodes.append(n)
    del G.g.node[:]
    G.g.node.extend(kept_nodes)
    float_bytes: dict[str, int] = {}
    keep = []
    for i in G.g.initializer:
        if i.name in replaced_inits:
            still = [n for n in G.consumers(i.name)]
            if not still and i.name not in outputs:
                float_bytes[i.name] = G.tensor(i.name).nbytes()
                removed_values.add(i.name)
                continue
            warnings.append(f"{i.name}: still read by {still[0].op_type} {still[0].name!r}; "
                            "the float table stays in the graph too")
        keep.append(i)
    for r in reports:
        r.float_bytes = float_bytes.pop(r.replaced, 0)
    bytes_before = _initializer_bytes(mp, G.base_dir)
    del G.g.initializer[:]
    G.g.initializer.extend(keep)
    vi = [v for v in G.g.value_info if v.name not in removed_values]
    del G.g.value_info[:]
    G.g.value_info.extend(vi)
    gi = [v for v in G.g.input if v.name not in removed_values]
    del G.g.input[:]
    G.g.input.extend(gi)
    if not any(o.domain == MS_DOMAIN for o in mp.opset_import):
        mp.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))

    # 5. record what this graph is
    meta = {
        "version": __version__,
        "overlay_format_version": str(cfg.get("format_version")),
        "min_onnxruntime": min_ort,
        "modules": json.dumps({r.module: {
            "op": r.op, "table": r.table, "scheme": r.scheme, "bits": r.bits,
            "block_size": r.block_size, "replaced": r.replaced, "source_check": r.source_check,
            "source_sha256": (cfg["modules"][r.table].get("source") or {}).get("sha256"),
        } for r in reports}, sort_keys=True),
        "source_sha256": json.dumps({m: (cfg["modules"][m].get("source") or {}).get("sha256")
                                     for m in sorted({r.table for r in reports})}, sort_keys=True),
        "scheme": json.dumps({m: scheme_of(cfg["modules"][m]).label()
                              for m in sorted({r.table for r in reports})}, sort_keys=True),
    }
    props = [p for p in mp.metadata_props if not p.key.startswith(META_PREFIX)]
    del mp.metadata_props[:]
    mp.metadata_props.extend(props)
    for k, v in meta.items():
        mp.metadata_props.append(onnx.StringStringEntryProto(key=META_PREFIX + k, value=v))

    if min_ort == MIN_ORT_ODD_BLOCKS_4BIT:
        warnings.append("asymmetric 4-bit rows with an odd number of blocks: onnxruntime 1.23-1.26 "
                        f"mis-decode their zero points; use onnxruntime >= {MIN_ORT_ODD_BLOCKS_4BIT}")
    bytes_after = bytes_before - sum(r.float_bytes for r in reports) \
        + sum(a.nbytes for a in new_tensors.values()) + sum(_Tensor(i, G.base_dir).nbytes() for i in extra_inits)
    had_external = any(t.data_location == _tp().EXTERNAL for t in _iter_tensors(mp))
    if external_data is None:
        external_data = had_external or bytes_after > PROTOBUF_LIMIT * 0.9
    if not external_data and bytes_after > PROTOBUF_LIMIT * 0.95:
        raise OnnxError(f"{out_path}: {bytes_after / 1e9:.2f} GB of initializers do not fit one "
                        "protobuf file; pass --external-data")
    G.g.initializer.extend(extra_inits)
    file_bytes = _write_model(mp, G.base_dir, out_path, new_tensors, external_data)
    del G
    return OnnxReport(str(src_path), str(out_path), str(ov_path), reports, bytes_before, bytes_after,
                      file_bytes, external_data, min_ort, time.perf_counter() - t0, None, warnings)


# --------------------------------------------------------------------------- write

def _copy_range(src: Path, offset: int, length: int, dst) -> None:
    with open(src, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            buf = f.read(min(CHUNK_BYTES, left))
            if not buf:
                raise OnnxError(f"{src}: external data ends early (wanted {length} bytes at {offset})")
            dst.write(buf)
            left -= len(buf)


def _external_entries(t) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def _set_external(t, location: str, offset: int, length: int) -> None:
    from onnx import TensorProto
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    t.data_location = TensorProto.EXTERNAL
    t.ClearField("raw_data")


def _write_model(mp, src_dir: Path, out: Path, new_tensors: dict[str, np.ndarray],
                 external: bool) -> int:
    """Write the model (and its external data) atomically; return the bytes written."""
    from onnx import TensorProto, helper, numpy_helper
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_model = out.parent / f".{out.name}.embedq-tmp-{os.getpid()}"
    data_name = f"{out.name}.data"
    tmp_data = out.parent / f".{data_name}.embedq-tmp-{os.getpid()}"
    protos = []
    for name, arr in new_tensors.items():
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(arr.dtype))
        t.dims.extend(arr.shape)
        protos.append((t, arr))
    try:
        if external:
            with open(tmp_data, "wb") as fd:
                def place(t, writer) -> None:
                    pos = fd.tell()
                    big = _Tensor(t, src_dir).nbytes() >= SMALL_TENSOR
                    pad = (-pos) % (ALIGN if big else 64)
                    if pad:
                        fd.write(b"\0" * pad)
                        pos += pad
                    length = writer()
                    _set_external(t, data_name, pos, length)

                for t in list(_iter_tensors(mp)):
                    if t.data_location != TensorProto.EXTERNAL:
                        continue
                    info = _external_entries(t)
                    src = src_dir / info["location"]
                    off = int(info.get("offset", 0))
                    length = int(info["length"]) if "length" in info else _Tensor(t, src_dir).nbytes()

                    def w(src=src, off=off, length=length):
                        _copy_range(src, off, length, fd)
                        return length
                    place(t, w)
                for proto, arr in protos:
                    def w(arr=arr):
                        b = np.ascontiguousarray(arr)
                        fd.write(memoryview(b).cast("B"))
                        return b.nbytes
                    place(proto, w)
                    mp.graph.initializer.append(proto)
                fd.flush()
                os.fsync(fd.fileno())
        else:
            for t in list(_iter_tensors(mp)):
                if t.data_location == TensorProto.EXTERNAL:
                    info = _external_entries(t)
                    src = src_dir / info["location"]
                    off = int(info.get("offset", 0))
                    length = int(info["length"]) if "length" in info else _Tensor(t, src_dir).nbytes()
                    with open(src, "rb") as f:
                        f.seek(off)
                        t.raw_data = f.read(length)
                    del t.external_data[:]
                    t.data_location = TensorProto.DEFAULT
            for proto, arr in protos:
                mp.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(arr), proto.name))
        data = mp.SerializeToString()
        with open(tmp_model, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        size = len(data)
        if external:
            size += tmp_data.stat().st_size
            os.replace(tmp_data, out.parent / data_name)
        os.replace(tmp_model, out)
        return size
    finally:
        for p in (tmp_model, tmp_data):
            if p.exists():
                p.unlink()


# -------------------------------------------------------------------------- export

class _LogitsOnly(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def load_float_model(model_dir: str | os.PathLike, overlay: str | os.PathLike | None = None,
                     dtype: torch.dtype = torch.float32):
    """The transformers causal LM of ``model_dir`` in ``dtype``, with float tables.

    An embedq ``quantization_config`` in config.json is ignored (the float source
    shards are still there in place); a table missing from the shards (a derived
    checkpoint) is filled with the overlay's dequantized values.
    """
    import transformers as tf

    from embedq.format.reader import load_overlay
    p = Path(model_dir)
    try:
        cfg = tf.AutoConfig.from_pretrained(p)
    except Exception as e:
        raise OnnxError(f"{p / 'config.json'}: not a transformers config ({e})") from None
    qc = getattr(cfg, "quantization_config", None)
    if qc is not None:
        qd = qc if isinstance(qc, dict) else qc.to_dict()
        if qd.get("quant_method") == QUANT_METHOD and qd.get("base_quantization_config"):
            raise OnnxError(f"{p / 'config.json'}: the model has a base quantization "
                            f"({qd['base_quantization_config'].get('quant_method')}); "
                            "embedq onnx export handles float checkpoints only")
        if qd.get("quant_method") != QUANT_METHOD:
            raise OnnxError(f"{p / 'config.json'}: quantized with {qd.get('quant_method')}; "
                            "embedq onnx export handles float checkpoints only")
        del cfg.quantization_config
    try:
        model, info = tf.AutoModelForCausalLM.from_pretrained(
            p, config=cfg, dtype=dtype, output_loading_info=True)
    except Exception as e:
        raise OnnxError(f"{p}: cannot load as a transformers causal LM ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    missing = set(info.get("missing_keys") or [])
    if missing:
        ov = load_overlay(overlay or p)
        sd = model.state_dict()
        filled = set()
        for name, entry in ov.config["modules"].items():
            tensor = (entry.get("source") or {}).get("tensor", f"{name}.weight")
            for key in (tensor, f"{name}.weight"):
                if key in missing and key in sd:
                    with torch.no_grad():
                        sd[key].copy_(ov.tables[name].dequantize(torch.float32).to(dtype))
                    filled.add(key)
        for alias, owner in (ov.config.get("aliases") or {}).items():
            key = f"{alias}.weight"
            if key in missing and key in sd:
                with torch.no_grad():
                    sd[key].copy_(ov.tables[owner].dequantize(torch.float32).to(dtype))
                filled.add(key)
        rest = sorted(missing - filled)
        if rest:
            raise OnnxError(f"{p}: weights missing from the checkpoint: {', '.join(rest[:5])}")
    return model.eval()


def export_float(model, path: str | os.PathLike, *, opset: int | None = None,
                 optimize: bool = True) -> float:
    """``torch.onnx.export(dynamo=True)`` of a causal LM returning logits; external data.

    Inputs: ``input_ids`` [batch, seq] (both dynamic); output: ``logits``.
    ``optimize=False`` skips onnxscript's graph optimizer (about half the export time
    of Gemma 3 270M; ONNX Runtime optimizes the graph itself at load).
    Returns the export time in seconds.
    """
    import logging
    import warnings as _w
    t0 = time.perf_counter()
    ids = torch.randint(0, min(100, model.config.get_text_config().vocab_size), (2, 8))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    try:
        with _w.catch_warnings(), torch.no_grad():
            _w.simplefilter("ignore")
            prog = torch.onnx.export(_LogitsOnly(model), (ids,), dynamo=True,
                                     input_names=["input_ids"], output_names=["logits"],
                                     dynamic_shapes=({0: batch, 1: seq},), opset_version=opset,
                                     optimize=optimize, verbose=False)
            prog.save(str(path), external_data=True)
    except Exception as e:
        raise OnnxError(f"torch.onnx.export failed for {type(model).__name__}: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    return time.perf_counter() - t0


def export_model(model_dir: str | os.PathLike, output: str | os.PathLike, *,
                 overlay: str | os.PathLike | None = None, dtype: str = "float32",
                 external_data: bool | None = None, force: bool = False,
                 opset: int | None = None, optimize: bool = True) -> OnnxReport:
    """Export ``model_dir`` (a transformers causal LM) to ONNX and patch it with its overlay."""
    from embedq.format.reader import read_overlay_config
    from embedq.format.dtypes import dtype_from_name
    t0 = time.perf_counter()
    mdir, out = Path(model_dir), Path(output)
    ov_dir = Path(overlay) if overlay is not None else mdir
    read_overlay_config(ov_dir)  # fail before the slow part
    if dtype not in ("float32", "float16"):
        raise OnnxError(f"--dtype {dtype}: expected float32 or float16 (ONNX Runtime CPU has no bf16 kernels)")
    if out.exists() and not force:
        raise OnnxError(f"{out}: already exists (pass --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    model = load_float_model(mdir, ov_dir, dtype_from_name(dtype))
    with tempfile.TemporaryDirectory(prefix=".embedq-onnx-", dir=out.parent) as tmp:
        fpath = Path(tmp) / "float.onnx"
        t_exp = export_float(model, fpath, opset=opset, optimize=optimize)
        del model
        if external_data is None:  # one file unless it would not fit protobuf's 2 GB
            external_data = _estimate_patched(fpath, ov_dir) > PROTOBUF_LIMIT * 0.9
        report = patch_model(fpath, ov_dir, out, external_data=external_data, force=force)
    report.model = str(mdir)
    report.export_seconds = t_exp
    report.seconds = time.perf_counter() - t0
    return report


def _estimate_patched(fpath: Path, ov_dir: Path) -> int:
    """Rough size of the patched model: the float file minus the quantized tables' savings."""
    from embedq.format.reader import read_overlay_config
    size = sum(f.stat().st_size for f in fpath.parent.iterdir())
    cfg = read_overlay_config(ov_dir)
    for e in cfg["modules"].values():
        v, h = e["shape"]
        size -= v * h * 4 * (1 - e["num_bits"] / 32)
    return int(size)


def read_metadata(path: str | os.PathLike) -> dict:
    """The ``embedq.*`` metadata_props of a patched model (JSON values decoded)."""
    mp = _load_model(Path(path))
    out = {}
    for p in mp.metadata_props:
        if p.key.startswith(META_PREFIX):
            k = p.key[len(META_PREFIX):]
            try:
                out[k] = json.loads(p.value) if k in ("modules", "source_sha256", "scheme") else p.value
            except json.JSONDecodeError:
                out[k] = p.value
    return out


__all__ = ["patch_model", "export_model", "export_float", "load_float_model", "OnnxReport",
           "OnnxModuleReport", "OnnxError", "onnx_block_size", "ort_scales", "ort_zero_points",
           "ort_weight_bytes", "check_source", "read_metadata"]
