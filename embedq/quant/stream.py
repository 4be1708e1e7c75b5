"""Streaming over the rows of a table: read a chunk, quantize it, hand it on."""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import threading
import warnings
import math
from dataclasses import dataclass
from typing import Callable

import torch

from embedq.errors import SchemeError
from embedq.quant.fused import chunk_stats, quantize_pack
from embedq.quant.profile import PROFILE, stage
from embedq.format.codec import pack_int32
from embedq.quant.rtn import quantize_rtn
from embedq.format.scheme import Scheme

# About 2 MiB of source per chunk: the fused kernel's passes over a chunk hit L2/L3,
# per-chunk overhead stays small, and the peak memory is independent of the table size.
TARGET_CHUNK_BYTES = 2 << 20
ROW_ALIGN = 64  # zero points are packed along rows: keep chunks word-aligned for any bits


def default_chunk_rows(cols: int, itemsize: int) -> int:
    rows = max(ROW_ALIGN, TARGET_CHUNK_BYTES // max(1, cols * itemsize))
    return rows // ROW_ALIGN * ROW_ALIGN


def quantize_chunk(x: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype, calibration=None):
    """Quantize one chunk of rows with the scheme's method: ``(q, scale, zp)``.

    ``calibration`` (:class:`embedq.quant.gptq.Calibration`) is what ``gptq`` needs."""
    if scheme.method == "mse":
        from embedq.quant.mse import quantize_mse
        return quantize_mse(x, scheme, scale_dtype)
    if scheme.method == "gptq":
        from embedq.quant.gptq import quantize_gptq
        return quantize_gptq(x, scheme, scale_dtype, calibration)
    return quantize_rtn(x, scheme, scale_dtype)


@dataclass
class ErrorStats:
    """Reconstruction error accumulated over chunks.

    A NaN or infinity anywhere (source or reconstruction) is remembered in ``finite``
    and makes ``max_abs`` infinite: ``max(0.0, nan)`` would silently read as 0.
    """

    max_abs: float = 0.0
    sq_err: float = 0.0
    sq_ref: float = 0.0
    count: int = 0
    finite: bool = True

    def update(self, x: torch.Tensor, xhat: torch.Tensor) -> None:
        d = xhat - x
        self.add(float(d.abs().max()) if d.numel() else 0.0, float((d.double() ** 2).sum()),
                 float((x.double() ** 2).sum()), x.numel())

    def add(self, max_abs: float, sq_err: float, sq_ref: float, count: int) -> None:
        """Merge one chunk's already-reduced statistics."""
        if not (math.isfinite(max_abs) and math.isfinite(sq_err) and math.isfinite(sq_ref)):
            self.finite = False
            max_abs = math.inf
        self.max_abs = max(self.max_abs, max_abs)
        self.sq_err += sq_err
        self.sq_ref += sq_ref
        self.count += count

    @property
    def rms(self) -> float:
        if not self.finite:
            return math.inf
        return (self.sq_err / self.count) ** 0.5 if self.count else 0.0

    @property
    def rel_rms(self) -> float:
        if not self.finite:
            return math.inf
        return (self.sq_err / self.sq_ref) ** 0.5 if self.sq_ref else 0.0


class NonFiniteSource(SchemeError):
    """A source table holds NaN or infinity (quantizing it would hide or spread it)."""

    def __init__(self, where: str, row: int, what: str):
        super().__init__(f"{where}: row {row} holds {what}; embedq refuses to quantize "
                         "non-finite values (fix or re-export the checkpoint)")
        self.row = row


def check_finite(x: torch.Tensor, row0: int, where: str) -> None:
    """Raise :class:`NonFiniteSource` naming the first row of ``x`` with a NaN/inf.

    A full extra pass over the chunk (~3.9 CPU s per GB): the quantizing pipeline runs it
    only on chunks that :func:`stats_finite` flags."""
    if x.dtype.is_floating_point and not bool(torch.isfinite(x).all()):
        bad = ~torch.isfinite(x)
        r = int(bad.any(dim=-1).nonzero()[0, 0]) if x.dim() > 1 else int(bad.nonzero()[0, 0])
        row = x[r] if x.dim() > 1 else x
        what = "NaN" if bool(torch.isnan(row).any()) else "an infinity"
        raise NonFiniteSource(where, row0 + r, what)


def stats_finite(st) -> bool:
    """Whether a chunk's kernel statistics ``(max_abs, sq_err, sq_ref)`` are all finite.

    Every kernel (native, inductor, eager) sums ``x*x`` over the chunk; a NaN or an
    infinity in ``x`` makes that sum NaN or infinite, whatever the order of the additions.
    So finite statistics prove a finite chunk at no cost beyond the kernel's own pass.
    The converse does not hold (huge finite values can overflow a float32 sum): a chunk
    with non-finite statistics gets the exact :func:`check_finite`, which names the row.
    """
    return all(math.isfinite(v) for v in st)


# --- the fast path: fused kernels, mapped reads, overlapped stages --------------------

def quantize_pack_chunk(x: torch.Tensor, scheme: Scheme, scale_dtype: torch.dtype,
                        pad_rows: int | None = None, compiled: bool | None = None,
                        calibration=None):
    """Quantize and pack one chunk: ``(packed_int32, scale, zero_point, stats)``.

    RTN goes through :func:`embedq.quant.fused.quantize_pack` (compiled fused
    kernel where possible, ``compiled=False`` for the eager reference); other methods
    through :func:`quantize_chunk` and :func:`pack_int32`. Same bytes either way.
    ``stats`` is ``(max_abs, sq_err, sq_ref)``.
    """
    if scheme.method == "rtn":
        return quantize_pack(x, scheme, scale_dtype, True, compiled=compiled, pad_rows=pad_rows)
    q, scale, zp = quantize_chunk(x, scheme, scale_dtype, calibration)
    return pack_int32(q, scheme.bits), scale, zp, chunk_stats(x, q, scale, zp, scheme.group_size)


class MappedRows:
    """Rows of a 2-D tensor stored raw in a file, mapped read-only, never copied.

    ``rows(a, b)`` is a zero-copy tensor over the page cache. :meth:`release` drops the
    pages of rows already processed from this process (``MADV_DONTNEED``; they stay in
    the page cache), so the resident memory stays about one chunk whatever the table
    size — a plain mapping would count every page touched so far as resident.
    """

    def __init__(self, path: str | os.PathLike, offset: int, shape: tuple[int, int],
                 dtype: torch.dtype, name: str | None = None):
        self.path = str(path)
        self.name = name  # the tensor's name, for error messages
        self.shape = shape
        self.dtype = dtype
        self.row_bytes = shape[1] * torch.empty((), dtype=dtype).element_size()
        nbytes = shape[0] * self.row_bytes
        fd = os.open(self.path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < offset + nbytes:
                raise OSError(0, f"truncated file ({size} bytes, tensor ends at {offset + nbytes})")
            start = offset // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
            self._base = offset - start
            self._mm = mmap.mmap(fd, self._base + nbytes, access=mmap.ACCESS_READ, offset=start)
        finally:
            os.close(fd)
        self._view = memoryview(self._mm)
        self._page = mmap.PAGESIZE
        self._populate = hasattr(self._mm, "madvise")

    def byte_range(self, a: int, b: int) -> tuple[int, int]:
        return self._base + a * self.row_bytes, self._base + b * self.row_bytes

    def buffer(self, a: int, b: int) -> memoryview:
        lo, hi = self.byte_range(a, b)
        return self._view[lo:hi]

    def rows(self, a: int, b: int) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "non-writable buffer": never written
            t = torch.frombuffer(self.buffer(a, b), dtype=self.dtype)
        return t.view(b - a, self.shape[1])

    def prefetch(self, a: int, b: int) -> None:
        """Map the pages of rows a..b in one call (fewer page faults later)."""
        if not self._populate:
            return
        lo, hi = self.byte_range(a, b)
        lo -= lo % self._page
        try:
            self._mm.madvise(_MADV_POPULATE_READ, lo, hi - lo)
        except (OSError, ValueError):
            self._populate = False  # kernel older than 5.14: plain page faults

    def release(self, a: int, b: int) -> None:
        """Unmap the whole pages of rows a..b from this process (page cache kept)."""
        if not hasattr(self._mm, "madvise"):
            return
        lo, hi = self.byte_range(a, b)
        lo -= lo % self._page
        hi -= hi % self._page  # the partial last page is shared with the next rows
        if hi > lo:
            try:
                self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        self._view.release()
        try:
            self._mm.close()
        except BufferError:  # a chunk tensor still alive somewhere: the GC closes it
            pass

    def __enter__(self) -> "MappedRows":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def source_label(source) -> str:
    """``<file>: <tensor>``, as errors about a source table name it."""
    return source.path + (f": {source.name}" if getattr(source, "name", None) else "")


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_SYNC_FILE_RANGE_WRITE = 2
_STOP = object()


def _start_writeback():
    """``sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)`` where libc has it, else None."""
    try:
        import ctypes
        import ctypes.util
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        f = libc.sync_file_range
        f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        f.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return f


class Pipeline:
    """Read, quantize and write a table chunk by chunk with the three stages overlapped.

    - a reader thread maps the next chunk (``prefetch``) and hashes the source bytes;
    - the calling thread runs ``compute(row, x)`` (the fused kernel);
    - a writer thread runs ``write(row, out)`` (pwrite + output hashes) and asks the
      kernel to start writing those pages back to disk, so the final fsync has little
      left to wait for.

    hashlib, pread/pwrite and the kernels release the GIL, so on two cores the stages
    run in parallel. Queues are bounded (``depth`` chunks), which bounds the memory.
    Any exception (in a thread, or a KeyboardInterrupt in the caller) stops all stages
    before it propagates; nothing is written after :meth:`run` returns or raises.

    ``precheck`` runs :func:`check_finite` on every chunk before ``compute`` (a full extra
    pass); the quantizing job passes False and tests the kernel's statistics instead
    (:func:`stats_finite`). ``digest`` is the source hasher (default sha256).
    """

    WRITEBACK_BYTES = 32 << 20

    def __init__(self, source: MappedRows, chunk_rows: int,
                 compute: Callable[[int, torch.Tensor], object],
                 write: Callable[[int, object], None], *, writer_fd: int | None = None,
                 depth: int = 2, threads: bool | None = None, kernel_threads: int | None = None,
                 precheck: bool = True, digest=None):
        self.source = source
        self.chunk_rows = chunk_rows
        self.compute = compute
        self.write = write
        self.writer_fd = writer_fd
        self.depth = depth
        rows = source.shape[0]
        nchunks = -(-rows // chunk_rows)
        self.threads = (nchunks >= 4) if threads is None else threads
        self.kernel_threads = kernel_threads
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        # precheck=False: ``compute`` refuses non-finite chunks itself (stats_finite).
        self.precheck = precheck
        self.hash = digest if digest is not None else hashlib.sha256()

    def _compute(self, a: int, x: torch.Tensor):
        if self.precheck:
            with stage("finite check (full pass)"):
                check_finite(x, a, source_label(self.source))
        return self.compute(a, x)

    def _chunks(self):
        rows = self.source.shape[0]
        for r0 in range(0, rows, self.chunk_rows):
            yield r0, min(rows, r0 + self.chunk_rows)

    def _put(self, q: queue.Queue, item) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, q: queue.Queue):
        while not self._stop.is_set():
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                continue
        return _STOP

    def _reader(self, out_q: queue.Queue) -> None:
        try:
            with stage("read: loop + queue (Python)"):
                for a, b in self._chunks():
                    if self._stop.is_set():
                        return
                    with stage("read: map pages (MADV_POPULATE_READ)"):
                        self.source.prefetch(a, b)
                    with stage("read: hash source"):
                        self.hash.update(self.source.buffer(a, b))
                    if not self._put(out_q, (a, b)):
                        return
                self._put(out_q, _STOP)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            self._errors.append(e)
            self._stop.set()
        finally:
            PROFILE.thread_done()

    def _writer(self, in_q: queue.Queue) -> None:
        pending = 0
        try:
            with stage("write: loop + queue (Python)"):
                sync = _start_writeback() if self.writer_fd is not None else None
                while True:
                    item = self._get(in_q)
                    if item is _STOP:
                        return
                    r0, out = item
                    self.write(r0, out)
                    if sync is not None:
                        pending += sum(getattr(t, "nbytes", 0) for t in out)
                        if pending >= self.WRITEBACK_BYTES:
                            # Start writeback of everything written so far (async, no wait).
                            with stage("write: sync_file_range"):
                                sync(self.writer_fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
                            pending = 0
        except BaseException as e:  # noqa: BLE001
            self._errors.append(e)
            self._stop.set()
        finally:
            PROFILE.thread_done()

    def run(self) -> str:
        """Process every chunk; return the source's digest (hex)."""
        if not self.threads:
            with stage("pipeline: per-chunk Python (1 thread)"):
                for a, b in self._chunks():
                    with stage("read: hash source"):
                        self.hash.update(self.source.buffer(a, b))
                    out = self._compute(a, self.source.rows(a, b))
                    with stage("release pages (MADV_DONTNEED)"):
                        self.source.release(a, b)
                    self.write(a, out)
            return self.hash.hexdigest()
        read_q: queue.Queue = queue.Queue(self.depth)
        write_q: queue.Queue = queue.Queue(self.depth)
        reader = threading.Thread(target=self._reader, args=(read_q,), name="embedq-read", daemon=True)
        writer = threading.Thread(target=self._writer, args=(write_q,), name="embedq-write", daemon=True)
        old_threads = torch.get_num_threads()
        # Kernel threads (native: row ranges of a chunk; others: torch's intra-op pool):
        # cores - 2 leaves the reader and writer a core each, but at least 2 where there are
        # 2 cores: the reader and writer need well under a core, and the kernel takes the rest.
        cores = os.cpu_count() or 1
        kt = self.kernel_threads or int(os.environ.get("EMBEDQ_KERNEL_THREADS", "0") or 0) \
            or min(cores, max(2, cores - 2))
        started = []
        try:
            torch.set_num_threads(min(kt, old_threads))
            for t in (reader, writer):
                t.start()
                started.append(t)
            with stage("pipeline: per-chunk Python + queues"):
                while True:
                    item = self._get(read_q)
                    if item is _STOP:
                        break
                    a, b = item
                    out = self._compute(a, self.source.rows(a, b))
                    with stage("release pages (MADV_DONTNEED)"):
                        self.source.release(a, b)
                    if not self._put(write_q, (a, out)):
                        break
                self._put(write_q, _STOP)
        except BaseException:
            self._stop.set()
            raise
        finally:
            if self._errors:
                self._stop.set()
            for t in started:  # nothing may write after we return
                t.join()
            torch.set_num_threads(old_threads)
        if self._errors:
            raise self._errors[0]
        return self.hash.hexdigest()
