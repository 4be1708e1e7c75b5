"""Writing the patched model: external data streamed, page-aligned, atomic."""

from __future__ import annotations

import contextlib
import filecmp
import os
from pathlib import Path
from typing import Iterable, Iterator

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


def _referenced(model: Path) -> set[str] | None:
    """The external data locations the model file at ``model`` names; None if unreadable."""
    try:
        import onnx
        mp = onnx.load(str(model), load_external_data=False)
    except Exception:  # a damaged or foreign file: it says nothing about which data is whose
        return None
    from onnx import TensorProto
    return {e.value for t in iter_tensors(mp) if t.data_location == TensorProto.EXTERNAL
            for e in t.external_data if e.key == "location"}


def data_generations(out: Path) -> tuple[str, str]:
    """The two names OUT's external data alternates between (``OUT.data``, ``OUT.1.data``)."""
    return f"{out.name}.data", f"{out.name}.1.data"


def _data_name(out: Path) -> tuple[str, set[str]]:
    """The data file name for a new OUT and the generation names to remove after it.

    The new data never takes a name the current OUT reads: renaming it over that file
    before OUT itself would pair, until OUT is renamed, a graph with another graph's data
    (a kill in between would keep that pairing). So an in-place patch writes the other
    generation; the model renamed last switches both at once. Only what OUT reads is
    stale: with no OUT (or an unreadable one) nothing is, whatever lies beside it.
    """
    gens = data_generations(out)
    if not (out.parent / gens[0]).exists():
        return gens[0], _stale(out, {gens[0]})
    reads = _referenced(out) if out.exists() else set()
    name = gens[1] if gens[0] in (reads if reads is not None else set(gens)) else gens[0]
    return name, _stale(out, {name})


def _stale(out: Path, keep: set[str]) -> set[str]:
    """The data generations the current OUT reads, but ``keep``: replaced with OUT."""
    reads = (_referenced(out) or set()) if out.is_file() else set()
    return {g for g in data_generations(out) if g in reads and g not in keep}


def folder_inputs(folder: Path) -> list[Path]:
    """The files of an input model or overlay folder a command must never write over
    (:func:`~embedq.format.files.folder_files`), but ONNX graphs and their data, which are
    earlier outputs (``--force`` replaces them)."""
    from embedq.format.files import folder_files
    return folder_files(folder, (".onnx", ".data"))


def check_not_input(out: Path, inputs: Iterable[Path]) -> None:
    """Refuse an output that is, or whose data file would be, one of the files the command
    reads (through links too): --force replaces an earlier output, never an input."""
    ins = {os.path.realpath(p) for p in inputs}
    for p in (out, *(out.parent / g for g in data_generations(out))):
        if os.path.realpath(p) in ins:
            raise OnnxError(f"{p}: is one of this command's input files; write the output elsewhere")


def check_output_file(out: Path) -> None:
    """A single model is written as a file: refuse a folder before any work."""
    if out.is_dir():
        raise OnnxError(f"{out}: is a folder; name the .onnx file to write (e.g. {out / 'model.onnx'})")


@contextlib.contextmanager
def new_parents(path: Path) -> Iterator[None]:
    """Create ``path``'s missing parent folders; if the body fails, remove those of them
    it left empty, so a refused or failed run leaves no trace."""
    made, p = [], Path(path).parent
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        for d in made:  # deepest first; one not empty keeps those above it
            try:
                d.rmdir()
            except OSError:
                break
        raise


def clean_generations(out: Path, keep: set[Path] = frozenset()) -> list[str]:
    """Remove the data generation OUT does not read (left by a run killed after renaming
    OUT, before removing the old data), unless it is in ``keep`` (what the source reads);
    announce and return the names removed."""
    from embedq.format import staging
    now = _referenced(out) if out.is_file() else None
    if now is None:  # no OUT, or unreadable: nothing says which data is stale
        return []
    gone = [g for g in data_generations(out) if g not in now and (out.parent / g).is_file()
            and (out.parent / g).resolve() not in keep]
    for g in gone:
        staging.remove(out.parent / g)
    if gone:
        staging.announce(out.parent, gone)
    return gone


def clean_output(out: Path, src_dir: Path, mp, src_model: Path | None) -> None:
    """Before anything else of a patch to ``out``: remove what a killed run left (staged
    files, a data generation ``out`` no longer reads), keeping what the source reads."""
    from embedq.format import staging
    staging.clean_leftovers(out.parent, [out.name, *data_generations(out)])
    clean_generations(out, _source_files(out, src_dir, mp, src_model))


def _source_files(out: Path, src_dir: Path, mp, src_model: Path | None) -> set[Path]:
    """The data files the source reads, unless the source is ``out`` (in place: they are
    the old generation, replaced)."""
    from onnx import TensorProto
    if src_model is not None and Path(src_model).resolve() == out.resolve():
        return set()
    return {external_data(t, src_dir)[0].resolve() for t in iter_tensors(mp)
            if t.data_location == TensorProto.EXTERNAL}


def write_model(mp, src_dir: Path, out: Path, new_tensors: dict[str, np.ndarray],
                 external: bool, src_model: Path | None = None, force: bool = False) -> int:
    with new_parents(out):
        return _write_model(mp, src_dir, out, new_tensors, external, src_model, force)


def _write_model(mp, src_dir: Path, out: Path, new_tensors: dict[str, np.ndarray],
                 external: bool, src_model: Path | None, force: bool) -> int:
    """Write the model (and its external data) atomically; return the bytes written.

    Both files are staged (embedq.format.staging) and fsynced; the data is renamed to a
    name OUT does not read yet (:func:`_data_name`), then OUT is renamed last, then the
    previous generation is removed — unless the source model (``src_model``, when it is not
    OUT) reads it. A kill at any point leaves the old OUT with its data,
    or the new OUT with its data, and staging names the next run removes; a failure to
    rename OUT takes the new data back. A data file of the needed name that OUT does not
    read is replaced only with ``force``, or when it holds the very bytes written (what a
    run killed before renaming OUT left).
    """
    from onnx import TensorProto, helper, numpy_helper
    from embedq.format import staging
    keep = _source_files(out, src_dir, mp, src_model)  # (the caller ran clean_output first)
    data_name, stale = _data_name(out) if external else (None, _stale(out, set()))
    tmp_model = staging.partial_path(out)
    tmp_data = staging.partial_path(out.parent / data_name) if external else None
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
        data_path = out.parent / data_name if external else None
        if external:
            size += tmp_data.stat().st_size
            if data_path.exists() and not force and not filecmp.cmp(tmp_data, data_path, shallow=False):
                raise OnnxError(f"{data_path}: already exists and {out} does not read it "
                                "(pass --force to replace it, or choose another output)")
            staging.commit(tmp_data, data_path)
            staging.kill_point("onnx-data")
        try:
            staging.commit(tmp_model, out)  # last: OUT switches to its new data here
        except BaseException:
            if data_path is not None:  # a name OUT does not read: the old state again
                staging.remove(data_path)
            raise
        for g in stale:  # the generation no model reads any more (a source's data stays)
            if (out.parent / g).is_file() and (out.parent / g).resolve() not in keep:
                staging.remove(out.parent / g)
        return size
    except OSError as e:  # about a staging name: said as OUT, the name the user gave
        err = staging.output_error(e, out, [p for p in (tmp_model, tmp_data) if p is not None])
        if err is e:
            raise
        raise err from e
    finally:
        for p in (tmp_model, tmp_data):
            if p is not None:
                staging.remove(p)


