"""Writing the patched model: external data streamed, page-aligned, atomic."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from embedq.backends.onnx.common import (ALIGN, CHUNK_BYTES, SMALL_TENSOR, OnnxError, iter_tensors,
                                         TensorRef, external_data)


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


def _set_external(t, location: str, offset: int, length: int) -> None:
    from onnx import TensorProto
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    t.data_location = TensorProto.EXTERNAL
    t.ClearField("raw_data")


def write_model(mp, src_dir: Path, out: Path, new_tensors: dict[str, np.ndarray],
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
                    big = TensorRef(t, src_dir).nbytes() >= SMALL_TENSOR
                    pad = (-pos) % (ALIGN if big else 64)
                    if pad:
                        fd.write(b"\0" * pad)
                        pos += pad
                    length = writer()
                    _set_external(t, data_name, pos, length)

                for t in list(iter_tensors(mp)):
                    if t.data_location != TensorProto.EXTERNAL:
                        continue
                    src, off, length = external_data(t, src_dir)
                    if length is None:
                        length = TensorRef(t, src_dir).nbytes()

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
            for t in list(iter_tensors(mp)):
                if t.data_location == TensorProto.EXTERNAL:
                    src, off, length = external_data(t, src_dir)
                    if length is None:
                        length = TensorRef(t, src_dir).nbytes()
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


