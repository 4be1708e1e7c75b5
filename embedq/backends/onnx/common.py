"""Constants, errors, dtypes, ONNX Runtime block layout and initializer access."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from embedq.errors import EmbedqError, UnsafePathError
from embedq.format.files import inside
from embedq.format.scheme import ONNX_MIN_BLOCK, onnx_block


MS_DOMAIN = "com.microsoft"
#: GatherBlockQuantized on uint8 data needs onnxruntime >= 1.23 (1.20-1.22 reject uint8);
#: 1.23-1.26 mis-decode 4-bit zero points of rows with an odd number of blocks (exact for
#: symmetric tables thanks to midpoint padding, see ort_zero_points; asymmetric need 1.27).
MIN_ORT = "1.23"
MIN_ORT_ODD_BLOCKS_4BIT = "1.27"
MIN_BLOCK = ONNX_MIN_BLOCK
ALIGN = 4096  # external data offsets of big tensors: page-aligned so runtimes can mmap them
SMALL_TENSOR = 1 << 16  # smaller ones are 64-byte aligned
PROTOBUF_LIMIT = 2_000_000_000
CHUNK_BYTES = 16 << 20
SAMPLE_ROWS = 512
META_PREFIX = "embedq."


class OnnxError(EmbedqError):
    """An ONNX graph cannot be exported or patched with this overlay."""


def require_onnx(export: bool = False) -> None:
    """Raise :class:`OnnxError` (one CLI line) when the ``onnx`` extra is not installed;
    ``export``: also onnxscript, which ``torch.onnx.export(dynamo=True)`` needs."""
    missing = []
    for mod in ("onnx", "onnxruntime", *(("onnxscript",) if export else ())):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise OnnxError(f"{', '.join(missing[:-1])}{' and ' if len(missing) > 1 else ''}{missing[-1]} "
                        "not installed: pip install 'embedq[onnx]'")


# --------------------------------------------------------------------------- dtypes

def tensor_proto():
    from onnx import TensorProto
    return TensorProto


def _np_dtype(elem_type: int) -> np.dtype:
    TP = tensor_proto()
    table = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16, TP.BFLOAT16: np.uint16,
             TP.DOUBLE: np.float64, TP.INT64: np.int64, TP.INT32: np.int32, TP.INT8: np.int8,
             TP.UINT8: np.uint8, TP.INT16: np.int16, TP.UINT16: np.uint16, TP.BOOL: np.bool_}
    try:
        return np.dtype(table[elem_type])
    except KeyError:
        raise OnnxError(f"unsupported initializer data type {elem_type}") from None


def torch_dtype_of(elem_type: int) -> torch.dtype:
    TP = tensor_proto()
    return {TP.FLOAT: torch.float32, TP.FLOAT16: torch.float16, TP.BFLOAT16: torch.bfloat16}[elem_type]


def float_types() -> set[int]:
    TP = tensor_proto()
    return {TP.FLOAT, TP.FLOAT16, TP.BFLOAT16}


# ------------------------------------------------------------------ block layout

def onnx_block_size(bits: int, group_size: int | None, cols: int) -> int:
    """ONNX Runtime block size for a table: the largest power of two dividing its group.

    A group (or, per-row, the whole row) becomes ``group/block`` blocks that repeat
    its scale and zero point. Raises :class:`OnnxError` when that block is < 16.
    """
    block = onnx_block(cols if group_size is None else group_size)  # format.scheme: the one rule
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

class TensorRef:
    """Lazy access to an initializer's values: inline raw data, typed fields or external."""

    def __init__(self, proto, base_dir: Path, model_path: Path | None = None):
        self.proto = proto
        self.base_dir = base_dir
        self.model_path = model_path
        self._arr: np.ndarray | None = None

    @property
    def dims(self) -> list[int]:
        return list(self.proto.dims)

    @property
    def elem_type(self) -> int:
        return self.proto.data_type

    @property
    def external(self) -> bool:
        return self.proto.data_location == tensor_proto().EXTERNAL

    def array(self) -> np.ndarray:
        """The values as an array (memory-mapped for external data; bf16 as uint16)."""
        if self._arr is not None:
            return self._arr
        dt = _np_dtype(self.elem_type)
        shape = tuple(self.dims)
        where = f"{self.model_path or self.base_dir}: initializer {self.proto.name!r}"
        if any(d < 0 for d in shape):
            raise OnnxError(f"{where}: negative dims {list(shape)}")
        need = self.nbytes()
        if self.external:
            path, off, length = external_data(self.proto, self.base_dir, self.model_path)
            size = path.stat().st_size
            if (length is not None and length != need) or off + need > size:
                raise OnnxError(f"{where}: external data ({path.name}, offset {off}, length {length}) "
                                f"does not hold its {need} bytes (file {size} bytes)")
            self._arr = np.memmap(path, dtype=dt, mode="r", offset=off, shape=shape) if need else \
                np.zeros(shape, dtype=dt)
        elif self.proto.HasField("raw_data"):
            if len(self.proto.raw_data) != need:
                raise OnnxError(f"{where}: raw_data holds {len(self.proto.raw_data)} bytes, dims "
                                f"{list(shape)} need {need}")
            self._arr = np.frombuffer(self.proto.raw_data, dtype=dt).reshape(shape)
        else:
            from onnx import numpy_helper
            try:
                a = numpy_helper.to_array(self.proto)
            except (ValueError, TypeError) as e:
                raise OnnxError(f"{where}: values do not fit dims {list(shape)} ({e})") from None
            self._arr = a.view(np.uint16) if self.elem_type == tensor_proto().BFLOAT16 else a
        return self._arr

    def rows(self, a: int, b: int, transposed: bool) -> torch.Tensor:
        """Rows ``a:b`` of the logical ``[V, H]`` table (``transposed``: stored ``[H, V]``)."""
        arr = self.array()
        chunk = np.array(arr[:, a:b].T if transposed else arr[a:b], order="C", copy=True)
        if self.elem_type == tensor_proto().BFLOAT16:
            return torch.from_numpy(chunk.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(chunk)

    def nbytes(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n * _np_dtype(self.elem_type).itemsize


def external_data(proto, base_dir: Path, model_path: Path | None = None) -> tuple[Path, int, int | None]:
    """(file, offset, length or None) of a tensor's external data, refused unless safe.

    As onnx's checker requires, ``location`` must be a relative path that stays inside
    the model's folder (:func:`embedq.format.files.inside`: no absolute path, no ``..``,
    no link leading out but into a Hugging Face cache's ``blobs/``): a model file must
    not make embedq read, or copy into its output, arbitrary files.
    """
    info = {e.key: e.value for e in proto.external_data}
    where = f"{model_path or base_dir}: initializer {proto.name!r}"
    loc = info.get("location", "")
    try:
        path = inside(base_dir, loc)
    except UnsafePathError:
        raise OnnxError(f"{where}: external data location {loc!r} is not a relative path inside "
                        f"the model's folder {Path(base_dir).resolve()}; refusing to read it") from None
    path = path.resolve()
    if not path.is_file():
        raise OnnxError(f"{where}: external data file {path} is missing")
    try:
        off = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise OnnxError(f"{where}: external data offset/length are not integers") from None
    if off < 0 or (length is not None and length < 0):
        raise OnnxError(f"{where}: negative external data offset/length")
    return path, off, length


def check_external_data(model, base_dir: Path, model_path: Path) -> None:
    """Refuse the model before anything is read if any external data location is unsafe."""
    for t in iter_tensors(model):
        if t.data_location == tensor_proto().EXTERNAL:
            external_data(t, base_dir, model_path)


def iter_graphs(graph) -> Iterator:
    """The graph and every subgraph (If/Loop/Scan bodies)."""
    from onnx import AttributeProto
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                yield from iter_graphs(attr.g)
            elif attr.type == AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from iter_graphs(g)


def iter_tensors(model) -> Iterator:
    """Every TensorProto that can carry (external) data: initializers and attributes."""
    from onnx import AttributeProto
    for g in iter_graphs(model.graph):
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


