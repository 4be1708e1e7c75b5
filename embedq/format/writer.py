"""A streaming safetensors writer.

The safetensors library can only serialize tensors that are all in memory. Here the
header is computed up front from dtypes and shapes, the file is pre-sized, and
tensor data is written piecewise at known offsets, so a table never has to exist
in memory in full. The file is written under a temporary name and only renamed to
its final name after every byte was written and fsynced, so a partial file never
carries the final name.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from embedq.errors import OverlayError
from embedq.format.dtypes import DTYPE_TO_ST_NAME as _ST_DTYPES
from embedq.format.staging import fsync_dir, kill_point, partial_path  # noqa: F401 (fsync_dir: re-exported)

_ITEMSIZE = {d: torch.empty((), dtype=d).element_size() for d in _ST_DTYPES}


# Test hook: signal this process (SIGKILL by default: no cleanup at all) after N
# data writes, so tests can prove an interrupted run never leaves a valid-looking
# overlay and never touches the source.
_KILL_AFTER = int(os.environ.get("EMBEDQ_TEST_KILL_AFTER_WRITES", "0") or 0)
_KILL_SIGNAL = os.environ.get("EMBEDQ_TEST_KILL_SIGNAL", "KILL")
_writes_done = 0


def safetensors_dtype(dtype: torch.dtype) -> str:
    return _ST_DTYPES[dtype]


class StreamingSafetensorsWriter:
    """Write a safetensors file tensor by tensor, row block by row block.

    >>> with StreamingSafetensorsWriter(path, {"a": (torch.int32, (4, 2))}) as w:
    ...     w.write("a", torch.zeros(2, 2, dtype=torch.int32), row=0)
    ...     w.write("a", torch.ones(2, 2, dtype=torch.int32), row=2)

    Every declared byte must be written before the context exits, otherwise the
    temporary file is deleted and an error raised.
    """

    def __init__(self, path: str | os.PathLike, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None, tmp_path: str | os.PathLike | None = None):
        self.path = Path(path)
        self.tmp_path = Path(tmp_path) if tmp_path else partial_path(self.path)
        self._specs: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name, (dtype, shape) in tensors.items():
            nbytes = math.prod(shape) * _ITEMSIZE[dtype]
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._specs[name] = (dtype, tuple(shape), offset, nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the library writes it
        self._header = len(raw).to_bytes(8, "little") + raw
        self.data_bytes = offset
        self.total_bytes = len(self._header) + offset
        self._written = {name: 0 for name in tensors}
        self._fd: int | None = None

    @property
    def sizes(self) -> dict[str, int]:
        """Declared tensor names and their data sizes in bytes, in file order."""
        return {name: spec[3] for name, spec in self._specs.items()}

    def open(self) -> "StreamingSafetensorsWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # Reserve the space now so a full disk fails before any work is done.
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self._fd, 0, self.total_bytes)
            else:  # pragma: no cover
                os.ftruncate(self._fd, self.total_bytes)
            self._pwrite(self._header, 0)
        except OSError as e:
            self.abort()
            raise OverlayError(f"{self.path}: cannot write overlay: {e.strerror or e}") from e
        return self

    def _pwrite(self, data, offset: int) -> None:
        mv = memoryview(data).cast("B")
        while mv:
            n = os.pwrite(self._fd, mv, offset)
            mv = mv[n:]
            offset += n

    def write(self, name: str, data: torch.Tensor, row: int = 0) -> None:
        """Write ``data`` (rows of tensor ``name``) starting at row ``row``."""
        dtype, shape, start, nbytes = self._specs[name]
        if data.dtype != dtype or tuple(data.shape[1:]) != tuple(shape[1:]):
            raise ValueError(f"{name}: got {data.dtype} {list(data.shape)}, declared {dtype} {list(shape)}")
        row_bytes = math.prod(shape[1:]) * _ITEMSIZE[dtype]
        buf = data.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        self.write_bytes(name, buf, row * row_bytes)

    def write_bytes(self, name: str, buf, offset: int = 0) -> None:
        """Write raw little-endian bytes of tensor ``name`` at byte ``offset`` within it."""
        global _writes_done
        if _KILL_AFTER:
            _writes_done += 1
            if _writes_done > _KILL_AFTER:
                import signal
                os.kill(os.getpid(), getattr(signal, "SIG" + _KILL_SIGNAL))
        _, _, start, nbytes = self._specs[name]
        buf = memoryview(buf).cast("B")
        off = offset
        if off + buf.nbytes > nbytes or off < 0:
            raise ValueError(f"{name}: write past the end of the tensor")
        try:
            self._pwrite(buf, len(self._header) + start + off)
        except OSError as e:
            raise OverlayError(f"{self.path}: cannot write overlay: {e.strerror or e}") from e
        self._written[name] += buf.nbytes

    def finish(self) -> None:
        """Check every byte was written and fsync; the file keeps its temporary name."""
        missing = [n for n, s in self._specs.items() if self._written[n] != s[3]]
        if missing:
            self.abort()
            raise OverlayError(f"{self.path}: tensors not fully written: {', '.join(missing)}")
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
        except OSError as e:
            self.abort()
            raise OverlayError(f"{self.path}: cannot write overlay: {e.strerror or e}") from e

    def commit(self) -> Path:
        """Rename the finished file to its final name (atomic on POSIX)."""
        try:
            kill_point("staged")
            os.replace(self.tmp_path, self.path)
            fsync_dir(self.path.parent)
            kill_point("committed")
        except OSError as e:
            self.abort()
            raise OverlayError(f"{self.path}: cannot write overlay: {e.strerror or e}") from e
        return self.path

    def close(self) -> Path:
        """:meth:`finish` then :meth:`commit`."""
        if self._fd is not None:
            self.finish()
        return self.commit()

    def abort(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        try:
            self.tmp_path.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> "StreamingSafetensorsWriter":
        return self.open()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
