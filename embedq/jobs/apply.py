"""``embedq apply ./base --overlay DIR``: lay an overlay-only bundle onto a local base.

The bundle (``embedq quantize ... --overlay-only --output DIR``, or any folder with
``embedq.safetensors`` + ``quantization_config.json``) was made from one exact set of
source tables; its config records their sha256. ``apply`` hashes the base's tables
first and refuses a base whose tables differ, then installs the overlay exactly like
an in-place ``embedq quantize`` does (:mod:`embedq.jobs.state`): the overlay is
copied under a temporary name and checked against its recorded checksums, the
originals of config.json and the index are backed up in ``.embedq/``, and the edited
JSON files are replaced atomically, config.json last. ``embedq remove ./base``
restores the base byte for byte.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from embedq.errors import OverlayError
from embedq.jobs import state
from embedq.format.checkpoint import (CONFIG_NAME, OVERLAY_NAME, QCONFIG_NAME, Checkpoint,
                                        read_json, read_safetensors_header)
from embedq.format.config import scheme_of, validate_config
from embedq.format.constants import OVERLAY_FORMAT, ST_FLOAT_NAMES
from embedq.format.files import check_writable
from embedq.format.dtypes import ST_NAME_TO_DTYPE
from embedq.format.writer import StreamingSafetensorsWriter
from embedq.jobs.report import ModuleReport, Report

CHUNK = 64 << 20


def _sha256_range(path: Path, offset: int, nbytes: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for off in range(0, nbytes, CHUNK):
            h.update(os.pread(f.fileno(), min(CHUNK, nbytes - off), offset + off))
    return h.hexdigest()


def read_bundle(overlay: str | os.PathLike) -> tuple[dict, Path]:
    """The bundle's validated config and overlay file."""
    ov = Path(overlay)
    if not ov.is_dir():
        raise OverlayError(f"{ov}: no such overlay folder")
    qpath = ov / QCONFIG_NAME
    if not qpath.is_file():
        raise OverlayError(f"{qpath}: not found; {ov} is not an embedq overlay bundle")
    qconfig = validate_config(read_json(qpath), str(qpath))
    file = ov / qconfig.get("overlay", OVERLAY_NAME)
    if not file.is_file():
        raise OverlayError(f"{file}: overlay file missing from the bundle")
    return qconfig, file


def check_base(ckpt: Checkpoint, qconfig: dict) -> None:
    """Refuse a base whose source tables are not the ones the overlay was made from."""
    for name, entry in qconfig["modules"].items():
        src = entry.get("source") or {}
        tensor, want = src.get("tensor"), src.get("sha256")
        if not tensor or not want:
            raise OverlayError(f"quantization_config.json: module {name} records no source checksum; "
                               "cannot check the base")
        if not ckpt.has(tensor):
            raise OverlayError(f"{ckpt.path}: has no tensor {tensor}, which the overlay replaces "
                               "(a different model?)")
        info = ckpt.tensor(tensor)
        if list(info.shape) != list(entry["shape"]):
            raise OverlayError(f"{ckpt.path / info.file}: {tensor} has shape {list(info.shape)}, "
                               f"the overlay was made from {entry['shape']} (a different model?)")
        dt = ST_FLOAT_NAMES.get(info.dtype, info.dtype)
        if src.get("dtype") and dt != src["dtype"]:
            raise OverlayError(f"{ckpt.path / info.file}: {tensor} is {dt}, the overlay was made from "
                               f"{src['dtype']} (a different revision?)")
        got = _sha256_range(ckpt.path / info.file, info.file_offset, info.nbytes)
        if got != want:
            raise OverlayError(f"{ckpt.path / info.file}: {tensor} sha256 {got[:16]}… differs from the "
                               f"overlay's source {want[:16]}… (a different revision of the base?); refusing")


def apply_overlay(base: str | os.PathLike, overlay: str | os.PathLike, *, force: bool = False) -> Report:
    """Install the overlay bundle ``overlay`` into the checkpoint folder ``base``, in place.

    ``force`` replaces an embedq overlay the base already has (like ``quantize --force``).
    """
    qconfig, ovfile = read_bundle(overlay)
    base = Path(base)
    if base.exists() and base.resolve() == Path(overlay).resolve():
        raise OverlayError(f"{base}: the base and the overlay bundle are the same folder")
    ckpt = Checkpoint.open(base)
    base_qc = state.base_state(ckpt, force)
    want_qc = qconfig.get("base_quantization_config")
    if (base_qc or None) != (want_qc or None):
        have = (base_qc or {}).get("quant_method") if base_qc else None
        made = (want_qc or {}).get("quant_method") if want_qc else None
        raise OverlayError(f"{base / CONFIG_NAME}: quantization_config ({have or 'none'}) differs from the one "
                           f"the overlay was made on ({made or 'none'}); refusing")
    check_base(ckpt, qconfig)

    n, header = read_safetensors_header(ovfile)
    meta = header.get("__metadata__") or {}
    if meta.get("format") != OVERLAY_FORMAT:
        raise OverlayError(f"{ovfile}: not an embedq overlay (metadata format={meta.get('format')!r})")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    expected: dict[str, str] = {}
    for name, entry in qconfig["modules"].items():
        expected.update(entry.get("checksums") or {})
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            if f"{name}.{suffix}" not in tensors:
                raise OverlayError(f"{ovfile}: missing tensor {name}.{suffix}")
    for k in tensors:
        if k.endswith("lm_head.weight"):
            raise OverlayError(f"{ovfile}: holds {k}; an overlay never carries a float head")
    order = sorted(tensors, key=lambda k: tensors[k]["data_offsets"][0])
    try:
        decl = {k: (ST_NAME_TO_DTYPE[tensors[k]["dtype"]], tuple(tensors[k]["shape"])) for k in order}
    except KeyError as e:
        raise OverlayError(f"{ovfile}: unsupported tensor dtype {e}") from None

    check_writable(ckpt.path)
    state.cleanup_partials(ckpt.path)
    writer = StreamingSafetensorsWriter(ckpt.path / OVERLAY_NAME, decl, meta)
    writer.open()
    try:
        with open(ovfile, "rb") as f:
            for k in order:
                b, e = tensors[k]["data_offsets"]
                h = hashlib.sha256()
                for off in range(0, e - b, CHUNK):
                    data = os.pread(f.fileno(), min(CHUNK, e - b - off), 8 + n + b + off)
                    h.update(data)
                    writer.write_bytes(k, data, off)
                if k in expected and h.hexdigest() != expected[k]:
                    raise OverlayError(f"{ovfile}: tensor {k} does not match its recorded checksum "
                                       "(corrupt or incomplete download?)")
        writer.finish()
        state.commit_in_place(ckpt, writer, qconfig)
    except BaseException:
        writer.abort()
        raise

    aliases = qconfig.get("aliases") or {}
    reports = []
    for name, entry in qconfig["modules"].items():
        s = scheme_of(entry)
        rows, cols = entry["shape"]
        src = entry.get("source") or {}
        info = ckpt.tensor(src["tensor"])
        after = sum(tensors[k]["data_offsets"][1] - tensors[k]["data_offsets"][0]
                    for k in tensors if k.startswith(name + "."))
        reports.append(ModuleReport(name, src["tensor"], [rows, cols], s.label(),
                                    src.get("dtype", "?"), info.nbytes, after,
                                    role=entry.get("role", "embedding"),
                                    aliases=sorted(a for a, o in aliases.items() if o == name)))
    return Report(str(ckpt.path), "apply", reports, bool(qconfig.get("tie_word_embeddings")),
                  overlay=str(ckpt.path / OVERLAY_NAME))


__all__ = ["apply_overlay", "check_base", "read_bundle"]
