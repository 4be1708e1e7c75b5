"""Quantized tables split by rows so that no initializer exceeds a byte limit (WebGPU).

WebGPU creates one buffer per initializer and refuses one above the adapter's
``maxBufferSize`` (256 MiB unless the page asks for more); ONNX Runtime splits a buffer
across *bindings* above ``maxStorageBufferBindingSize`` by itself, but not an initializer
above ``maxBufferSize``. A part is a contiguous block of rows with its own packed data,
scales and zero points; the gather reads every part with the indices clamped into it and
keeps, per position, the part the index falls in (``Less`` + ``Where``); the head runs one
``MatMulNBits`` per part and concatenates the logits. Index arithmetic is int32 (the
WebGPU EP's native integer; a vocabulary is far below 2^31).
"""

from __future__ import annotations

import re

import numpy as np

from embedq.backends.onnx.common import MS_DOMAIN, OnnxError

#: WebGPU's default ``maxBufferSize`` (and ``maxStorageBufferBindingSize``'s is 128 MiB).
WEBGPU_MAX_BUFFER = 256 << 20
TARGETS = {"webgpu": WEBGPU_MAX_BUFFER}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_size(value) -> int:
    """``262144``, ``256KiB``, ``256MiB``, ``1GiB`` (or decimal kB/MB/GB) -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(value))
        unit = m and m.group(2).lower()
        if not m or unit not in _UNITS:
            raise OnnxError(f"--max-tensor-bytes {str(value)[:40]!r}: expected a byte count such as "
                            "262144, 256KiB or 256MiB")
        n = int(m.group(1)) * _UNITS[unit]
    if n <= 0:
        raise OnnxError(f"--max-tensor-bytes {value}: must be positive")
    return n


def resolve_limit(max_tensor_bytes, target: str | None) -> int | None:
    """The byte limit: an explicit ``max_tensor_bytes`` wins over ``target``'s."""
    if target is not None and target.lower() not in TARGETS:
        raise OnnxError(f"--target {target[:40]!r}: expected one of {', '.join(TARGETS)}")
    if max_tensor_bytes is not None:
        return parse_size(max_tensor_bytes)
    return TARGETS[target.lower()] if target is not None else None


def row_ranges(rows: int, row_bytes: int, limit: int | None, what: str) -> list[tuple[int, int]]:
    """Equal contiguous row ranges whose tensors (``row_bytes`` per row, the largest of the
    packed data, scales and zero points) each fit ``limit``."""
    if limit is None or rows * row_bytes <= limit:
        return [(0, rows)]
    per = limit // row_bytes
    if per == 0:
        raise OnnxError(f"--max-tensor-bytes {limit}: smaller than one row of {what} ({row_bytes} bytes)")
    n = -(-rows // per)
    size = -(-rows // n)  # balanced parts, each <= per rows
    return [(a, min(rows, a + size)) for a in range(0, rows, size)]


class NodeMaker:
    """Small helper: fresh names, int32 constants, nodes collected in order."""

    def __init__(self, fresh, opset: int):
        self.fresh = fresh
        self.opset = opset
        self.nodes: list = []
        self.inits: list = []

    def const(self, base: str, value, dtype=np.int32) -> str:
        from onnx import numpy_helper
        name = self.fresh(base)
        self.inits.append(numpy_helper.from_array(np.array(value, dtype), name))
        return name

    def node(self, op: str, inputs: list[str], base: str, outputs: list[str] | None = None,
             domain: str = "", **attrs) -> str:
        from onnx import helper
        outs = outputs or [self.fresh(base)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=self.fresh(f"{base}_node"),
                                           domain=domain, **attrs))
        return outs[0]


def split_gather(mk: NodeMaker, parts: list[dict], indices: str, output: str, base: str, bits: int,
                 block: int) -> list[str]:
    """GatherBlockQuantized per part, recombined into ``output``; returns the gather nodes' names."""
    from onnx import TensorProto
    ids = mk.node("Cast", [indices], f"{base}.ids32", to=TensorProto.INT32)
    zero = mk.const(f"{base}.zero", 0)
    gathered, names = [], []
    for k, p in enumerate(parts):
        local = mk.node("Sub", [ids, mk.const(f"{base}.part{k}.start", p["start"])], f"{base}.part{k}.local") \
            if p["start"] else ids
        clamped = mk.node("Clip", [local, zero, mk.const(f"{base}.part{k}.last", p["stop"] - p["start"] - 1)],
                          f"{base}.part{k}.clamped")
        gathered.append(mk.node("GatherBlockQuantized", [p["weight"], clamped, p["scales"], p["zp"]],
                                f"{base}.part{k}.rows", domain=MS_DOMAIN, bits=bits, block_size=block,
                                gather_axis=0, quantize_axis=1))
        names.append(mk.nodes[-1].name)
    if mk.opset >= 13:
        ids_u = mk.node("Unsqueeze", [ids, mk.const(f"{base}.last_axis", [-1], np.int64)], f"{base}.ids32_u")
    else:
        ids_u = mk.node("Unsqueeze", [ids], f"{base}.ids32_u", axes=[-1])
    res = gathered[-1]
    for k in range(len(parts) - 2, -1, -1):
        below = mk.node("Less", [ids_u, mk.const(f"{base}.part{k + 1}.start", parts[k + 1]["start"])],
                        f"{base}.in_part{k}")
        res = mk.node("Where", [below, gathered[k], res], f"{base}.upto{k}",
                      outputs=[output] if k == 0 else None)
    return names


def split_head(mk: NodeMaker, parts: list[dict], x: str, output: str, base: str, H: int, bits: int,
               block: int, accuracy_level: int) -> list[str]:
    """MatMulNBits per part, logits concatenated into ``output``; returns the MatMulNBits names."""
    logits, names = [], []
    for k, p in enumerate(parts):
        logits.append(mk.node("MatMulNBits", [x, p["reshape"], p["scales"], p["zp"]], f"{base}.part{k}.logits",
                              domain=MS_DOMAIN, K=H, N=p["stop"] - p["start"], bits=bits, block_size=block,
                              accuracy_level=accuracy_level))
        names.append(mk.nodes[-1].name)
    mk.node("Concat", logits, f"{base}.logits", outputs=[output], axis=-1)
    return names
