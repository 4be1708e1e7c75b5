"""``embedq verify``: re-read an overlay, check checksums, measure error against the source."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors import safe_open

from embedq.errors import OverlayError
from embedq.format.checkpoint import OVERLAY_NAME, Checkpoint
from embedq.format.config import scheme_of
from embedq.format.reader import load_overlay
from embedq.format.dtypes import dtype_from_name
from embedq.quant.stream import ErrorStats, default_chunk_rows
from embedq.jobs.report import ModuleReport, Report


def verify_overlay(path: str | os.PathLike) -> Report:
    """Check an overlay end to end; raise :class:`OverlayError` on any mismatch.

    Checks the overlay tensors' recorded checksums, and where the source table is
    still in the checkpoint (in-place overlays), its checksum (the base must not
    have changed) and the reconstruction error.
    """
    p = Path(path)
    ov = load_overlay(p)
    file = p / ov.config.get("overlay", OVERLAY_NAME)
    reports = []
    with safe_open(str(file), framework="pt") as f:
        for name, entry in ov.config["modules"].items():
            for tname, digest in (entry.get("checksums") or {}).items():
                got = hashlib.sha256(f.get_tensor(tname).contiguous().view(torch.uint8).numpy()).hexdigest()
                if got != digest:
                    raise OverlayError(f"{file}: tensor {tname} does not match its recorded checksum")
    try:
        ckpt = Checkpoint.open(p)
    except Exception:
        ckpt = None
    warnings = []
    for name, entry in ov.config["modules"].items():
        t = ov.tables[name]
        s = scheme_of(entry)
        src = entry.get("source") or {}
        dt = dtype_from_name(src.get("dtype", "bfloat16"))
        before = t.rows * t.cols * torch.empty((), dtype=dt).element_size()
        stats = None
        if ckpt is not None and ckpt.has(src.get("tensor", "")):
            info = ckpt.tensor(src["tensor"])
            h = hashlib.sha256()
            stats = ErrorStats()
            with safe_open(str(ckpt.path / info.file), framework="pt") as sf:
                sl = sf.get_slice(src["tensor"])
                cr = default_chunk_rows(t.cols, 4)
                for r0 in range(0, t.rows, cr):
                    x = sl[r0:r0 + cr]
                    h.update(x.contiguous().view(torch.uint8).numpy())
                    stats.update(x.float(), t.dequantize(torch.float32, slice(r0, r0 + cr)))
            if h.hexdigest() != src.get("sha256"):
                raise OverlayError(
                    f"{ckpt.path / info.file}: {src['tensor']} changed since the overlay was made "
                    "(checksum mismatch); re-run embedq quantize --force")
        else:
            warnings.append(f"{name}: source tensor not in this folder; checked overlay checksums only")
        reports.append(ModuleReport(
            name, src.get("tensor", ""), [t.rows, t.cols], s.label(), src.get("dtype", "?"),
            before, t.nbytes(), None if stats is None else stats.max_abs,
            None if stats is None else stats.rms, None if stats is None else stats.rel_rms,
            entry.get("role", "embedding"),
            sorted(a for a, o in (ov.config.get("aliases") or {}).items() if o == name)))
    return Report(str(p), "verify", reports, bool(ov.config.get("tie_word_embeddings")),
                  overlay=str(file), warnings=warnings)
