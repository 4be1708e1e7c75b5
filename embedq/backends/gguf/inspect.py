"""``embedq inspect X.gguf``: the GGUF's tables and what ``embedq gguf`` would make of it."""

from __future__ import annotations

import os

from embedq.backends.gguf.blocks import Q4_0, Q8_0
from embedq.backends.gguf.container import read_gguf
from embedq.backends.gguf.transcode import EMBEDDING, OUTPUT


def inspect_gguf(path: str | os.PathLike) -> dict:
    """Header only: the embedding / head tensors' types and bytes, and the file's exact size
    with those tables as Q8_0 (an ``--bits 8 --group-size 32 --scale-dtype float16``
    overlay) or Q4_0 (``--bits 4 ...``). Tied (no ``output.weight``): the embedding only.
    ``bytes_q4_0_head_q8_0``: a Q4_0 table and a Q8_0 head (``--bits 4 ... --head-bits 8
    --head-group-size 32``), over a tied GGUF with the ``output.weight`` that adds."""
    g = read_gguf(path)
    names = [n for n in (EMBEDDING, OUTPUT) if g.tensor(n) is not None]
    rows = []
    for n in names:
        t = g.tensor(n)
        rows.append({"tensor": n, "shape": list(t.shape), "type": t.type_name, "bytes": t.nbytes,
                     "bytes_q8_0": _retyped(g, {n: Q8_0}, n), "bytes_q4_0": _retyped(g, {n: Q4_0}, n)})
    return {
        "path": str(g.path), "format": "gguf", "gguf_version": g.version,
        "architecture": g.architecture, "tensors": len(g.tensors), "bytes": g.size,
        "tied": g.tensor(OUTPUT) is None, "tables": rows,
        "bytes_q8_0": g.layout({n: Q8_0 for n in names})[1],
        "bytes_q4_0": g.layout({n: Q4_0 for n in names})[1],
        "bytes_q4_0_head_q8_0": _q4_head_q8(g),
    }


def _q4_head_q8(g) -> int | None:
    """OUT's size with token_embd Q4_0 and output.weight Q8_0 (added to a tied GGUF where
    the architecture's loader reads one, else None)."""
    from embedq.backends.gguf.container import TensorInfo, tensor_nbytes
    from embedq.backends.gguf.transcode import TOKEN_EMBD_HEAD_ONLY
    emb = g.tensor(EMBEDDING)
    if emb is None or emb.dims[0] % 32:
        return None
    if g.tensor(OUTPUT) is not None:
        return g.layout({EMBEDDING: Q4_0, OUTPUT: Q8_0})[1]
    if g.architecture in TOKEN_EMBD_HEAD_ONLY or g.split_count > 1:
        return None
    head = TensorInfo(OUTPUT, emb.dims, Q8_0, 0, tensor_nbytes(emb.dims, Q8_0))
    return g.layout({EMBEDDING: Q4_0}, {EMBEDDING: head})[1]


def _retyped(g, types: dict, name: str) -> int | None:
    from embedq.backends.gguf.container import tensor_nbytes
    t = g.tensor(name)
    return tensor_nbytes(t.dims, types[name]) if t.dims[0] % 32 == 0 else None


def format_inspect_gguf(d: dict) -> str:
    mb = lambda b: "n/a" if b is None else f"{b / 1e6:.1f}"  # noqa: E731
    lines = [f"{d['path']}: GGUF v{d['gguf_version']}, {d['architecture']}, {d['tensors']} tensors, "
             f"{mb(d['bytes'])} MB, tied={d['tied']}"]
    fmt = "{:<18} {:<12} {:<6} {:>8} {:>9} {:>9}"
    lines.append(fmt.format("tensor", "shape", "type", "MB now", "MB Q8_0", "MB Q4_0"))
    for r in d["tables"]:
        lines.append(fmt.format(r["tensor"], "x".join(map(str, r["shape"])), r["type"], mb(r["bytes"]),
                                mb(r["bytes_q8_0"]), mb(r["bytes_q4_0"])))
    lines.append(f"file after `embedq gguf`: {mb(d['bytes_q8_0'])} MB with an int8 g32 overlay (Q8_0), "
                 f"{mb(d['bytes_q4_0'])} MB with a 4-bit g32 one (Q4_0); float16 scales, symmetric")
    if d.get("bytes_q4_0_head_q8_0") is not None:
        lines.append(f"  {mb(d['bytes_q4_0_head_q8_0'])} MB with a 4-bit g32 table and an 8-bit g32 head "
                     "(--head-bits 8 --head-group-size 32: token_embd Q4_0, output.weight Q8_0"
                     + (", added)" if d["tied"] else ")"))
    return "\n".join(lines)
