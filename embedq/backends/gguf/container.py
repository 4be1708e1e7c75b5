"""The GGUF container, read header-only (memory-mapped; tensor data never loaded).

GGUF v2/v3, little-endian (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):
magic, version, tensor and key/value counts, the key/value section, one info per tensor
(name, dims in ggml's ``ne`` order — innermost first, so a ``[rows, cols]`` table is
``[cols, rows]`` —, type, offset from the data start), padding to ``general.alignment``,
then the data. The key/value section is kept as a byte span: embedq copies it verbatim.
Type sizes come from gguf-py's table (``gguf.constants.GGML_QUANT_SIZES``).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from embedq.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, kv count
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_STRING, _ARRAY, _UINT32, _UINT16 = 8, 9, 4, 2
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


class GGUFError(CheckpointError):
    """A file that is not a GGUF, or a truncated / inconsistent one."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]   # ggml ne order: dims[0] is the row width
    type: int               # GGMLQuantizationType value
    offset: int             # from the data start
    nbytes: int

    @property
    def type_name(self) -> str:
        from gguf.constants import GGMLQuantizationType
        return GGMLQuantizationType(self.type).name

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (PyTorch) shape: ``dims`` reversed."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    size: int
    version: int
    kv_count: int
    kv_span: tuple[int, int]       # byte range of the key/value section
    keys: tuple[str, ...]
    alignment: int
    data_start: int
    tensors: tuple[TensorInfo, ...]
    architecture: str | None = None
    split_count: int = 0           # ``split.count`` (gguf-split shards), 0 when absent

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)

    def header_bytes(self, tensors: tuple[TensorInfo, ...] | None = None) -> int:
        """Bytes before the data (aligned): the same key/values and tensor names."""
        n = self.kv_span[1]
        for t in self.tensors if tensors is None else tensors:
            n += 8 + len(t.name.encode()) + 4 + 8 * len(t.dims) + 4 + 8
        return -(-n // self.alignment) * self.alignment

    def layout(self, types: dict[str, int] | None = None,
               added: dict[str, TensorInfo] | None = None) -> tuple[tuple[TensorInfo, ...], int]:
        """OUT's tensor infos (header order, data offsets set) and file size: some tensors
        retyped (``types``: name -> ggml type), and ``added`` ones (after -> new tensor: its
        info and its data right after that tensor's), BASE's order kept, each aligned."""
        types, added = types or {}, added or {}

        def with_added(seq):
            for t in seq:
                yield t
                if t.name in added:
                    yield added[t.name]
        infos = list(with_added(self.tensors))
        offsets, pos = {}, 0
        for t in with_added(sorted(self.tensors, key=lambda t: t.offset)):
            offsets[t.name] = pos
            pos += tensor_nbytes(t.dims, types.get(t.name, t.type))
            pos = -(-pos // self.alignment) * self.alignment
        out = tuple(TensorInfo(t.name, t.dims, types.get(t.name, t.type), offsets[t.name],
                               tensor_nbytes(t.dims, types.get(t.name, t.type))) for t in infos)
        return out, self.header_bytes(out) + pos


def type_size(ggml_type: int) -> tuple[int, int]:
    """(block elements, block bytes) of a ggml type (KeyError for an unknown one)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


def tensor_nbytes(dims: tuple[int, ...], ggml_type: int) -> int:
    block, size = type_size(ggml_type)
    n = 1
    for d in dims[1:]:
        n *= d
    return n * (dims[0] // block) * size


class _Cursor:
    """Bounds-checked little-endian reads from the mapped header."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF (header ends past the file's "
                            f"{len(self.buf)} bytes)")
        p = self.pos
        self.pos += n
        return p

    def u32(self) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8))[0]

    def string(self) -> str:
        n = self.u64()
        p = self.take(n)
        try:
            return bytes(self.buf[p:p + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: a GGUF string at byte {p} is not UTF-8") from None

    def skip_string(self) -> None:
        self.take(self.u64())

    def skip_value(self, vtype: int, depth: int = 0) -> None:
        if vtype in _SCALAR:
            self.take(_SCALAR[vtype])
        elif vtype == _STRING:
            self.skip_string()
        elif vtype == _ARRAY and depth < 8:
            itype, n = self.u32(), self.u64()
            if itype in _SCALAR:
                self.take(n * _SCALAR[itype])
            elif itype == _STRING:  # tokenizer vocabularies: 10^5-10^6 strings, one tight loop
                buf, pos, end, unpack = self.buf, self.pos, len(self.buf), struct.Struct("<Q").unpack_from
                # An explicit count, not the loop variable: an empty array (valid per the spec)
                # never binds it.
                read = 0
                while read < n:
                    if pos + 8 > end:
                        break
                    pos += 8 + unpack(buf, pos)[0]
                    read += 1
                if pos > end or read < n:
                    self.pos = end + 1
                    self.take(0)
                self.pos = pos
            else:
                for _ in range(n):
                    self.skip_value(itype, depth + 1)
        else:
            raise GGUFError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF's header and check that every tensor's data lies inside the file."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < HEADER.size:
                raise GGUFError(f"{p}: not a GGUF file ({size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return _parse(m, p, size)
    except IsADirectoryError:
        raise GGUFError(f"{p}: a folder, not a GGUF file") from None
    except FileNotFoundError:
        raise GGUFError(f"{p}: not found") from None


def _parse(m, p: Path, size: int) -> GGUFFile:
    magic, version, n_tensors, n_kv = HEADER.unpack_from(m, 0)
    if magic != MAGIC:
        raise GGUFError(f"{p}: not a GGUF file (magic {magic!r})")
    if version not in VERSIONS:
        raise GGUFError(f"{p}: GGUF version {version} is not supported (2 or 3)")
    c = _Cursor(m, p)
    c.take(HEADER.size)
    keys, alignment, arch, split = [], DEFAULT_ALIGNMENT, None, 0
    kv_start = c.pos
    for _ in range(n_kv):
        key = c.string()
        vtype = c.u32()
        if key == "general.alignment" and vtype == _UINT32:
            alignment = c.u32()  # bounds-checked: a file cut here is a truncated GGUF
        elif key == "split.count" and vtype == _UINT16:
            split = struct.unpack_from("<H", m, c.take(2))[0]
        elif key == "general.architecture" and vtype == _STRING:
            arch = c.string()
        else:
            c.skip_value(vtype)
        keys.append(key)
    kv_end = c.pos
    if alignment == 0 or alignment & (alignment - 1):
        raise GGUFError(f"{p}: general.alignment {alignment} is not a power of two")
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        nd = c.u32()
        if not 1 <= nd <= MAX_DIMS:
            raise GGUFError(f"{p}: tensor {name[:80]!r} has {nd} dimensions")
        dims = tuple(c.u64() for _ in range(nd))
        infos.append((name, dims, c.u32(), c.u64()))
    data_start = -(-c.pos // alignment) * alignment
    tensors, seen = [], set()
    for name, dims, ttype, off in infos:
        if name in seen:
            raise GGUFError(f"{p}: tensor {name[:80]!r} appears twice")
        seen.add(name)
        try:
            block, _ = type_size(ttype)
        except (KeyError, ValueError):
            raise GGUFError(f"{p}: tensor {name[:80]!r} has unknown ggml type {ttype}") from None
        if dims[0] % block or off % alignment:
            raise GGUFError(f"{p}: tensor {name[:80]!r} ({list(dims)}, offset {off}) does not fit "
                            "its type's blocks or the file's alignment")
        nbytes = tensor_nbytes(dims, ttype)
        if data_start + off + nbytes > size:
            raise GGUFError(f"{p}: truncated GGUF: tensor {name[:80]!r} ends at byte "
                            f"{data_start + off + nbytes}, the file has {size}")
        tensors.append(TensorInfo(name, dims, ttype, off, nbytes))
    return GGUFFile(p, size, version, n_kv, (kv_start, kv_end), tuple(keys), alignment,
                    data_start, tuple(tensors), arch, split)
