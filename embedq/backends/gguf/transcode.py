"""``embedq gguf``: a GGUF whose token embedding (output head, per-layer embedding) hold an
overlay's tables.

OUT is BASE with ``token_embd.weight`` — and ``output.weight`` where the overlay has a
separate head, or where BASE has one and the overlay's head reads the embedding — holding
the overlay's codes and scales as Q8_0 / Q4_0 blocks (a re-layout, nothing re-rounded).
The key/value section is copied verbatim and every other tensor byte for byte, in chunks
(BASE is never read into memory). A tied BASE (no ``output.weight``) stays tied, unless
the overlay's head has its own table (``--head-bits``: llama.cpp's own shape, a 4-bit
lookup and an 8-bit head): then ``output.weight`` is added right after ``token_embd``
(the tensor count +1, no key changes: llama.cpp's loaders take an ``output.weight`` when
present and fall back to ``token_embd``). A per-layer input embedding (Gemma 3n's) goes
into BASE's ``per_layer_token_embd.weight`` by the same rules, in place; where BASE has
none or no GGUF type holds its scheme exactly, OUT keeps BASE's and a note says why.
OUT is staged (embedq.format.staging) and renamed; BASE and the overlay are only read.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from embedq.backends.gguf.blocks import BITS_TYPE, BLOCK_BYTES, QK, encode
from embedq.backends.gguf.check import check_rows, gguf_rounding
from embedq.backends.gguf.container import (HEADER, GGUFError, GGUFFile, TensorInfo, read_gguf,
                                            tensor_nbytes, type_size)
from embedq.errors import OverlayError, SchemeError
from embedq.format.constants import CONFIG_NAME, QCONFIG_NAME, is_head_name
from embedq.format.files import folder_files

EMBEDDING, OUTPUT = "token_embd.weight", "output.weight"
PER_LAYER = "per_layer_token_embd.weight"  # llama.cpp's Gemma 3n embed_tokens_per_layer
EXACT_FLAGS = "`--bits 8 --group-size 32 --scale-dtype float16` or `--bits 4 --group-size 32 --scale-dtype float16`"
CHUNK_ROWS = 16384
COPY_CHUNK = 16 << 20


@dataclass
class GGUFTableReport:
    tensor: str
    module: str
    shape: list[int]            # [rows, cols]
    type_before: str
    type_after: str
    bytes_before: int
    bytes_after: int
    scheme: str
    check_ratio: float          # worst distance / bound of the same-model check (<= 1)


@dataclass
class GGUFReport:
    base: str
    output: str
    tables: list[GGUFTableReport]
    tied: bool
    bytes_before: int
    bytes_after: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        import json
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        fmt = "{:<18} {:<22} {:<12} {:<6} {:<6} {:>9} {:>9}"
        lines = [fmt.format("tensor", "from module", "shape", "was", "now", "MB was", "MB now")]
        for t in self.tables:
            lines.append(fmt.format(t.tensor, t.module, "x".join(map(str, t.shape)), t.type_before,
                                    t.type_after, f"{t.bytes_before / 1e6:.1f}", f"{t.bytes_after / 1e6:.1f}"))
        lines.append(f"{self.output}: {self.bytes_after / 1e6:.1f} MB (base {self.bytes_before / 1e6:.1f} MB), "
                     f"tied={self.tied}")
        lines += self.notes
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _inexact(scheme, cols: int) -> str | None:
    """Why no ggml type holds ``scheme`` exactly, or None where Q8_0 / Q4_0 does."""
    g = scheme.group_size if scheme.group_size is not None else cols
    if scheme.symmetric and scheme.scale_dtype == "float16" and g % QK == 0 and cols % QK == 0:
        return None
    return ("asymmetric (GGUF's Q8_0/Q4_0 have no zero points)" if not scheme.symmetric else
            f"{scheme.scale_dtype} scales (Q8_0/Q4_0 store float16)" if scheme.scale_dtype != "float16"
            else f"groups of {g} (Q8_0/Q4_0 need a multiple of 32)")


def gguf_type_for(scheme, cols: int, where: str, module: str) -> int:
    """The ggml type holding ``scheme`` exactly (Q8_0 / Q4_0), or a SchemeError naming the
    flags that make one."""
    why = _inexact(scheme, cols)
    if why is None:
        return BITS_TYPE[scheme.bits]
    raise SchemeError(f"{where}: module {module} is {scheme.label()}, {why}: GGUF cannot hold it "
                      f"exactly; quantize with {EXACT_FLAGS}")


@dataclass
class _Job:
    tensor: str        # GGUF tensor name written
    module: str        # overlay module whose table it takes
    table: object      # QuantizedTable
    scheme: object
    ggml_type: int
    source_dtype: str | None
    against: str       # BASE tensor the table must be a quantization of (token_embd for an added head)
    added: bool = False


# Architectures whose llama.cpp loader reads the head from token_embd only, never an
# output.weight: there an added tensor fails the load ("done_getting_tensors: wrong number of
# tensors"). From node-llama-cpp 3.21.1's llama.cpp (ggml-org/llama.cpp src/models/*.cpp,
# load_arch_tensors: these create `output` from LLM_TENSOR_TOKEN_EMBD with TENSOR_DUPLICATED
# and no LLM_TENSOR_OUTPUT); every other tied architecture (llama, gemma3, qwen2/3, phi3, ...)
# creates output.weight with TENSOR_NOT_REQUIRED and falls back to token_embd when absent.
TOKEN_EMBD_HEAD_ONLY = frozenset({"command-r", "cohere2", "gemma", "gemma2", "gemma4-assistant",
                                  "openelm", "pockettts"})


def _may_add_head(base: GGUFFile, emb, head, where: str) -> None:
    """A tied BASE, an overlay whose head has its own table: OUT gets an added output.weight
    where llama.cpp would read it; refuse (one line) where it would not, or where the head
    is not the embedding table's (an overlay of another model)."""
    if emb.source.digest and head.source.digest and emb.source.digest != head.source.digest:
        raise OverlayError(f"{where}: the overlay's head {head.name} was made from {head.source.tensor}, "
                           f"not from its embedding table ({emb.source.tensor}), and {base.path} is tied "
                           f"(no {OUTPUT}): an overlay of another model")
    if base.architecture in TOKEN_EMBD_HEAD_ONLY:
        raise SchemeError(f"{where}: the overlay's head {head.name} has its own scheme "
                          f"({head.scheme.label()}), but llama.cpp's {base.architecture} models read the "
                          f"head from token_embd only (no {OUTPUT}): quantize without --head-bits / "
                          "--head-group-size (a tied head)")
    if base.split_count > 1:
        raise GGUFError(f"{base.path}: a split GGUF (split.count {base.split_count}): adding {OUTPUT} would "
                        "change its shards' tensor counts; merge it first (llama-gguf-split --merge)")


def _left_out(base: GGUFFile, m, why: str | None = None) -> str:
    """The note for an overlay module OUT does not take: an MTP/draft table (no GGUF tensor),
    or a per-layer input embedding (Gemma 3n's) that BASE lacks or that no GGUF type holds
    exactly (``why``): OUT keeps BASE's own as it is."""
    if m.role != "per_layer":
        return f"module {m.name} ({m.role}) has no GGUF tensor: left out"
    t = base.tensor(PER_LAYER)
    if t is None:
        return f"module {m.name} (per_layer) left out: the base has no {PER_LAYER}"
    return (f"module {m.name} (per_layer) left out: {why}; OUT keeps the base's own {PER_LAYER} "
            f"({t.type_name}) as it is")


def _per_layer(base: GGUFFile, cfg) -> tuple[list[tuple], list[str]]:
    """The per-layer input embedding's (tensor, module, against) pair where BASE has a
    ``per_layer_token_embd`` and a GGUF type holds the scheme exactly (as for token_embd);
    else a note saying why OUT keeps BASE's. A shape not BASE's is refused later, as
    token_embd's is (an overlay of another model)."""
    pairs, notes = [], []
    info = base.tensor(PER_LAYER)
    for m in (m for m in cfg.modules.values() if m.role == "per_layer"):
        inexact = _inexact(m.scheme, m.shape[1])
        if info is None:
            why = None
        elif pairs:
            why = f"{PER_LAYER} already takes {pairs[0][1].name}"
        elif not _readable_type(info.type):
            why = f"the base's is {info.type_name}, which gguf-py cannot dequantize for the same-model check"
        elif inexact:
            why = (f"{m.scheme.label()}, {inexact}: no GGUF type holds it exactly "
                   f"(quantize with {EXACT_FLAGS} for Q8_0/Q4_0)")
        else:
            pairs.append((PER_LAYER, m, PER_LAYER))
            continue
        notes.append(_left_out(base, m, why))
    return pairs, notes


def _plan(base: GGUFFile, ov, where: str) -> tuple[list[_Job], list[str]]:
    cfg = ov.parsed
    emb = [m for m in cfg.modules.values() if m.role == "embedding"]
    if len(emb) != 1:
        raise OverlayError(f"{where}: {len(emb)} embedding tables; a GGUF has one (token_embd)")
    heads = [m for m in cfg.modules.values() if m.role == "head"]
    tied_to = [a for a, o in cfg.aliases.items() if o == emb[0].name and is_head_name(a)]
    notes = [_left_out(base, m) for m in cfg.modules.values()
             if m.role not in ("embedding", "head", "per_layer")]
    pairs = [(EMBEDDING, emb[0], EMBEDDING)]
    has_out = base.tensor(OUTPUT) is not None
    if heads and not has_out:  # tied BASE: the head's own table is a quantization of token_embd
        _may_add_head(base, emb[0], heads[0], where)
        pairs.append((OUTPUT, heads[0], EMBEDDING))
        notes.append(f"{OUTPUT} added (the base is tied; the overlay's head {heads[0].name} has its own "
                     "scheme): llama.cpp reads it for the head, token_embd for the lookup")
    elif heads:
        pairs.append((OUTPUT, heads[0], OUTPUT))
    elif tied_to and has_out:
        pairs.append((OUTPUT, emb[0], OUTPUT))  # BASE stores the tied head twice: keep both the same
    elif has_out:
        notes.append(f"{OUTPUT} kept as in the base (the overlay does not quantize the head)")
    per_layer, pl_notes = _per_layer(base, cfg)
    pairs += per_layer
    notes += pl_notes
    jobs = []
    for tensor, m, against in pairs:
        info = base.tensor(against)
        if info is None:
            raise GGUFError(f"{base.path}: no {against} tensor (not a language model GGUF?)")
        if not _readable_type(info.type):
            raise GGUFError(f"{base.path}: {against} is {info.type_name}, which gguf-py cannot dequantize "
                            "for the same-model check; use a GGUF whose table is F32, F16, BF16 or Q8_0")
        rows, cols = m.shape
        if info.dims != (cols, rows):
            raise OverlayError(f"{where}: module {m.name} is {rows}x{cols}, {base.path}'s {against} is "
                               f"{info.dims[-1] if len(info.dims) == 2 else list(info.dims)}x{info.dims[0]} "
                               "(ggml ne order [cols, rows]): an overlay of another model")
        jobs.append(_Job(tensor, m.name, ov.tables[m.name], m.scheme,
                         gguf_type_for(m.scheme, cols, where, m.name), m.source.dtype, against,
                         added=tensor != against))
    return jobs, notes


def _check(base: GGUFFile, f, job: _Job, where: str) -> float:
    """The same-model check of one table against BASE's ``job.against``, in row chunks
    (see :mod:`.check`)."""
    from gguf.quants import dequantize
    import torch
    info = base.tensor(job.against)
    name = f"{job.against} (for the added {job.tensor})" if job.added else job.tensor
    rows, cols = job.table.shape
    row_bytes = info.nbytes // rows
    worst = 0.0
    start = base.data_start + info.offset
    for r0 in range(0, rows, CHUNK_ROWS):
        r1 = min(rows, r0 + CHUNK_ROWS)
        f.seek(start + r0 * row_bytes)
        raw = np.frombuffer(f.read((r1 - r0) * row_bytes), np.uint8).reshape(r1 - r0, row_bytes)
        g = torch.from_numpy(np.require(dequantize(raw, info.type), np.float32, "CW").reshape(r1 - r0, cols))
        o = job.table.dequantize(torch.float32, rows=slice(r0, r1))
        worst = max(worst, check_rows(where, name, g, gguf_rounding(raw, g, info.type), o,
                                      job.table.scale[r0:r1], job.scheme.bits, job.scheme.method,
                                      job.source_dtype, r0))
    return worst


def added_tensors(base: GGUFFile, jobs) -> dict[str, TensorInfo]:
    """The tensors OUT adds (an output.weight over a tied BASE), keyed by the tensor they
    follow (token_embd): their info and data go right after it."""
    return {j.against: TensorInfo(j.tensor, base.tensor(j.against).dims, j.ggml_type, 0,
                                  tensor_nbytes(base.tensor(j.against).dims, j.ggml_type))
            for j in jobs if j.added}


def _readable_type(ggml_type: int) -> bool:
    """Whether gguf-py dequantizes tables of this type (the same-model check reads them):
    probed on one zero block, since its support (no F64, integer types, Q8_1...) varies by version."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize
    try:
        dequantize(np.zeros((1, type_size(ggml_type)[1]), np.uint8), GGMLQuantizationType(ggml_type))
    except (NotImplementedError, ValueError, KeyError):
        return False
    return True


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def transcode(base: str | os.PathLike, overlay: str | os.PathLike, output: str | os.PathLike,
              force: bool = False) -> GGUFReport:
    """Write OUT = BASE with the overlay's tables (see the module doc); refusals are one-line
    :class:`~embedq.errors.EmbedqError`\\ s and leave nothing behind."""
    from embedq.format.reader import load_overlay
    t0 = time.time()
    base, overlay, output = Path(base), Path(overlay), Path(output)
    if _same_file(base, output):
        raise GGUFError(f"{output}: is the base GGUF itself; write the result to another file")
    if output.is_dir():
        raise GGUFError(f"{output}: is a folder; name the GGUF file to write")
    if (output.exists() or output.is_symlink()) and not force:
        raise GGUFError(f"{output}: exists (pass --force to replace it)")
    from embedq.format.staging import clean_leftovers
    clean_leftovers(output.parent, [output.name])  # what a killed run of this OUT left
    info = read_gguf(base)
    ov = load_overlay(overlay)
    where = str(ov.parsed.where)
    # --force replaces OUT: never with one of the inputs (the overlay is read lazily, while OUT is written)
    for src in {ov.file, overlay / QCONFIG_NAME, overlay / CONFIG_NAME}:
        if src is not None and _same_file(src, output):
            raise GGUFError(f"{output}: is {src}, an input of this run (the overlay); "
                            "write the result to another file")
    # nor any other file of the overlay's folder (an in-place overlay's: the model's shards,
    # .embedq/'s backups), as onnx's --force: only an earlier .gguf output there is replaced
    for src in folder_files(overlay, (".gguf",)) if output.exists() else ():
        if _same_file(src, output):
            raise GGUFError(f"{output}: is a file of the overlay's folder {overlay} (not an earlier "
                            "GGUF output); write the result to another file")
    jobs, notes = _plan(info, ov, where)
    with open(base, "rb") as f:
        ratios = {j.tensor: _check(info, f, j, where) for j in jobs}
        size = _write(info, f, jobs, output)
    tables = []
    for j in jobs:
        t = info.tensor(j.tensor)
        dims = info.tensor(j.against).dims
        tables.append(GGUFTableReport(j.tensor, j.module, list(j.table.shape),
                                      "(added)" if t is None else t.type_name,
                                      {8: "Q8_0", 2: "Q4_0"}[j.ggml_type], 0 if t is None else t.nbytes,
                                      tensor_nbytes(dims, j.ggml_type), j.scheme.label(),
                                      round(ratios[j.tensor], 4)))
    tied = info.tensor(OUTPUT) is None and not any(j.added for j in jobs)
    return GGUFReport(str(base), str(output), tables, tied, info.size, size,
                      round(time.time() - t0, 2), notes)


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _write(info: GGUFFile, f, jobs: list[_Job], output: Path) -> int:
    """Header (the tensor count with any added tensor), verbatim key/values, OUT's tensor
    infos, then each tensor's data (aligned)."""
    from embedq.format.staging import staged
    a = info.alignment
    by_name = {j.tensor: j for j in jobs}
    tensors, want = info.layout({j.tensor: j.ggml_type for j in jobs if not j.added},
                                added_tensors(info, jobs))
    # the one commit (fsync, rename, fsync the folder; a kill leaves a name the next run removes)
    with staged(output) as tmp, open(tmp, "wb") as out:
        f.seek(0)
        magic, version, _, n_kv = HEADER.unpack(f.read(HEADER.size))
        out.write(HEADER.pack(magic, version, len(tensors), n_kv))
        _copy(f, out, HEADER.size, info.kv_span[1] - HEADER.size)   # key/values: verbatim
        for t in tensors:
            out.write(_string(t.name) + struct.pack(f"<I{len(t.dims)}QIQ", len(t.dims), *t.dims,
                                                    t.type, t.offset))
        out.write(b"\0" * (-out.tell() % a))
        data0 = out.tell()
        assert data0 == info.header_bytes(tensors)
        for t in sorted(tensors, key=lambda t: t.offset):
            out.write(b"\0" * (data0 + t.offset - out.tell()))
            if t.name in by_name:
                _write_table(out, by_name[t.name])
            else:
                src = info.tensor(t.name)
                _copy(f, out, info.data_start + src.offset, src.nbytes)
        out.write(b"\0" * (-(out.tell() - data0) % a))
        out.flush()
        size = out.tell()
        assert size == want, (size, want)
    return size


def _copy(f, out, start: int, n: int) -> None:
    f.seek(start)
    while n > 0:
        b = f.read(min(n, COPY_CHUNK))
        if not b:
            raise GGUFError(f"{f.name}: truncated while copying")
        out.write(b)
        n -= len(b)


def _write_table(out, job: _Job) -> None:
    rows, _ = job.table.shape
    for r0 in range(0, rows, CHUNK_ROWS):
        sl = slice(r0, min(rows, r0 + CHUNK_ROWS))
        out.write(encode(job.table.codes(sl), job.table.scale[sl], job.ggml_type).tobytes())


__all__ = ["GGUFReport", "GGUFTableReport", "transcode", "gguf_type_for", "EXACT_FLAGS", "BLOCK_BYTES"]
