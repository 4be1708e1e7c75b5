"""``embedq apply ./base --overlay DIR``: lay an overlay-only bundle onto a local base.

The bundle (``embedq quantize ... --overlay-only --output DIR``, or any folder with
``embedq.safetensors`` + ``quantization_config.json``) was made from one exact set of
source tables; its config records their digest (sha256 or BLAKE3). ``apply`` hashes the base's tables
first and refuses a base whose tables differ, then installs the overlay exactly like
an in-place ``embedq quantize`` does (:mod:`embedq.jobs.state`): the overlay is
copied under a temporary name and checked against its recorded checksums, the
originals of config.json and the index are backed up in ``.embedq/``, and the edited
JSON files are replaced atomically, config.json last. ``embedq remove ./base``
restores the base byte for byte.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from embedq.errors import EmbedqError, OverlayError, TieError
from embedq.jobs import state
from embedq.format.checkpoint import CONFIG_NAME, OVERLAY_NAME, QCONFIG_NAME, Checkpoint
from embedq.format.config import OverlayConfig, parse_config, read_config_file
from embedq.format.constants import ST_FLOAT_NAMES
from embedq.format.digest import new_hasher
from embedq.format.reader import check_overlay_header
from embedq.format.files import check_writable, inside
from embedq.format.dtypes import ST_NAME_TO_DTYPE
from embedq.format.writer import StreamingSafetensorsWriter
from embedq.jobs.report import ModuleReport, Report

if TYPE_CHECKING:
    from embedq.jobs.targets import Targets

CHUNK = 64 << 20


def _digest_range(path: Path, offset: int, nbytes: int, algorithm: str) -> str:
    h = new_hasher(algorithm)
    with open(path, "rb") as f:
        for off in range(0, nbytes, CHUNK):
            h.update(os.pread(f.fileno(), min(CHUNK, nbytes - off), offset + off))
    return h.hexdigest()


def read_bundle(overlay: str | os.PathLike) -> tuple[dict, Path]:
    """The bundle's validated config (as a dict) and overlay file."""
    cfg, file = parse_bundle(overlay)
    return cfg.to_dict(), file


def parse_bundle(overlay: str | os.PathLike) -> tuple[OverlayConfig, Path]:
    """The bundle's validated config and overlay file (whose header is checked against it)."""
    ov = Path(overlay)
    if not ov.is_dir():
        raise OverlayError(f"{ov}: no such overlay folder")
    qpath = inside(ov, QCONFIG_NAME)
    if not qpath.is_file():
        raise OverlayError(f"{qpath}: not found; {ov} is not an embedq overlay bundle")
    qconfig = read_config_file(qpath)
    file = inside(ov, qconfig.overlay, named_by=str(qpath))
    if not file.is_file():
        raise OverlayError(f"{file}: overlay file missing from the bundle")
    return qconfig, file


def check_base(ckpt: Checkpoint, qconfig: OverlayConfig | dict) -> None:
    """Refuse a base whose source tables are not the ones the overlay was made from,
    an overlay that replaces anything but the base's embeddings (per-layer ones too) and
    heads, and one that ties (or unties) a head the base does not. Every refusal that reads
    no table comes before the source tables are hashed (minutes on a big base)."""
    if isinstance(qconfig, dict):
        qconfig = parse_config(qconfig, "quantization_config.json")
    found = _base_targets(ckpt)
    allowed = None if found is None else \
        {x for x in [found[0].embedding, found[0].head, *found[0].extra_embeddings, *found[0].per_layer]
         if x}
    for name, entry in qconfig.modules.items():
        src = entry.source
        tensor = src.tensor
        if not src.digest:
            raise OverlayError(f"{qconfig.where}: module {name} records no source checksum; "
                               "cannot check the base")
        if not ckpt.has(tensor):
            raise OverlayError(f"{ckpt.path}: has no tensor {tensor}, which the overlay replaces "
                               "(a different model?)")
        if allowed is not None and tensor not in allowed:
            raise OverlayError(f"{qconfig.where}: module {name} replaces {tensor}, which is not an "
                               f"embedding or head of {ckpt.path}; refusing")
        info = ckpt.tensor(tensor)
        if list(info.shape) != list(entry.shape):
            raise OverlayError(f"{ckpt.path / info.file}: {tensor} has shape {list(info.shape)}, "
                               f"the overlay was made from {list(entry.shape)} (a different model?)")
        dt = ST_FLOAT_NAMES.get(info.dtype, info.dtype)
        if src.dtype and dt != src.dtype:
            raise OverlayError(f"{ckpt.path / info.file}: {tensor} is {dt}, the overlay was made from "
                               f"{src.dtype} (a different revision?)")
    for alias, owner in qconfig.aliases.items():
        if allowed is not None and ckpt.has(alias + ".weight") and alias + ".weight" not in allowed:
            raise OverlayError(f"{qconfig.where}: alias {alias} is not an embedding or head of {ckpt.path}")
    compare = found is not None and _tie_compares_tables(qconfig, *found)
    if found is not None and not compare:  # decided by config.json and the tensor names alone
        _check_tie(ckpt, qconfig, *found)
    for entry in qconfig.modules.values():
        src = entry.source
        info = ckpt.tensor(src.tensor)
        got = _digest_range(ckpt.path / info.file, info.file_offset, info.nbytes, src.algorithm)
        if got != src.digest:
            raise OverlayError(f"{ckpt.path / info.file}: {src.tensor} {src.algorithm} {got[:16]}… differs from "
                               f"the overlay's source {src.digest[:16]}… (a different revision of the base?); "
                               "refusing")
    if compare:  # reads both tables in full: only for a base whose source tables matched
        _check_tie(ckpt, qconfig, *found)


def _base_targets(ckpt: Checkpoint) -> tuple[Targets, bool] | None:
    """The base's targets (its input and output embeddings, MTP/draft and per-layer tables) and
    whether its config says tied (None when the model's targets cannot be determined)."""
    from embedq.jobs.targets import find_targets
    try:
        return find_targets(ckpt)
    except EmbedqError:
        return None


def _tie_compares_tables(qconfig: OverlayConfig, t: Targets, tied_cfg: bool) -> bool:
    """Whether :func:`_check_tie` reads the base's embedding and head in full to decide."""
    return bool(t.head and tied_cfg and not qconfig.tied)


def _check_tie(ckpt: Checkpoint, qconfig: OverlayConfig, t: Targets, tied_cfg: bool) -> None:
    """Refuse a bundle whose tie differs from the base's (overlay-format.md §4 rule 3: never
    tie an untied model, or untie a tied one, silently). The base's tie is decided by the
    rule ``quantize`` applies (:func:`embedq.jobs.targets.resolve_ties`); a base that rule
    cannot decide without ``--trust-config``/``--trust-tensors`` takes the choice the bundle
    records (made with one of them)."""
    from embedq.jobs.targets import resolve_ties
    identical = None  # resolve_ties reads it only for a head tensor under tie_word_embeddings=true
    if t.head and tied_cfg:
        if qconfig.tied:  # identical: tied; different: undecided, the bundle's choice. Either
            return        # way a tied bundle fits: no full read of two equal tables
        identical = ckpt.tensors_identical(t.embedding, t.head)
    try:
        base_tied = resolve_ties(t, tied_cfg, identical, None, str(ckpt.path / CONFIG_NAME))
    except TieError:
        return
    if base_tied == qconfig.tied:
        return
    fix = f"quantize the base itself: embedq quantize {ckpt.path} ..."
    if qconfig.tied:
        has = f"has its own head {t.head}" if t.head else "has no output embedding (head)"
        raise OverlayError(f"{qconfig.where}: the bundle ties the head to the embedding (made from a tied "
                           f"model), but the base {ckpt.path} is untied and {has}; applying it would "
                           f"serve the quantized embedding in its place; refusing; {fix}")
    raise OverlayError(f"{qconfig.where}: the bundle was made from an untied model (its head is a table of "
                       f"its own), but the base {ckpt.path} ties its head to the embedding; applying it "
                       f"would untie the base; refusing; {fix}")


def apply_overlay(base: str | os.PathLike, overlay: str | os.PathLike, *, force: bool = False) -> Report:
    """Install the overlay bundle ``overlay`` into the checkpoint folder ``base``, in place.

    ``force`` replaces an embedq overlay the base already has (like ``quantize --force``).
    """
    qconfig, ovfile = parse_bundle(overlay)
    for entry in qconfig.modules.values():  # before the base is touched (even locked)
        entry.require_checksums(qconfig.where, "re-create the bundle with embedq quantize "
                                               "--overlay-only --force")
    base = Path(base)
    if base.exists() and base.resolve() == Path(overlay).resolve():
        raise OverlayError(f"{base}: the base and the overlay bundle are the same folder")
    ckpt = Checkpoint.open(base)
    with state.folder_lock(ckpt.path, "apply"):  # read again under the lock: a killed
        return _apply(Checkpoint.open(base), qconfig, ovfile, force)  # run's overlay may be back


def _apply(ckpt: Checkpoint, qconfig: OverlayConfig, ovfile: Path, force: bool) -> Report:
    base = ckpt.path
    notes: list[str] = []
    base_qc = state.base_state(ckpt, force, warnings=notes)
    want_qc = qconfig.base_quantization_config
    if (base_qc or None) != (dict(want_qc) if want_qc else None):
        have = (base_qc or {}).get("quant_method") if isinstance(base_qc, dict) else None
        made = want_qc.get("quant_method") if want_qc else None
        raise OverlayError(f"{base / CONFIG_NAME}: quantization_config ({have or 'none'}) differs from the one "
                           f"the overlay was made on ({made or 'none'}); refusing")
    check_base(ckpt, qconfig)

    n, header = check_overlay_header(ovfile, qconfig)  # declared tensors only, sizes checked
    meta = header.get("__metadata__") or {}
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    expected: dict[str, str] = {}
    for entry in qconfig.modules.values():
        expected.update(entry.checksums)
    order = sorted(tensors, key=lambda k: tensors[k]["data_offsets"][0])
    decl = {k: (ST_NAME_TO_DTYPE[tensors[k]["dtype"]], tuple(tensors[k]["shape"])) for k in order}
    meta = {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}

    check_writable(ckpt.path)
    state.cleanup_partials(ckpt.path)
    writer = StreamingSafetensorsWriter(ckpt.path / OVERLAY_NAME, decl, meta)
    writer.open()
    try:
        with open(ovfile, "rb") as f:
            for k in order:
                b, e = tensors[k]["data_offsets"]
                h = new_hasher(qconfig.digest)
                for off in range(0, e - b, CHUNK):
                    data = os.pread(f.fileno(), min(CHUNK, e - b - off), 8 + n + b + off)
                    h.update(data)
                    writer.write_bytes(k, data, off)
                if k in expected and h.hexdigest() != expected[k]:
                    raise OverlayError(f"{ovfile}: tensor {k} does not match its recorded checksum "
                                       "(corrupt or incomplete download?)")
        writer.finish()
        _check_scales(ovfile, qconfig)
        state.commit_in_place(ckpt, writer, qconfig.to_dict())
    except BaseException:
        writer.abort()
        raise

    reports = []
    for name, entry in qconfig.modules.items():
        s = entry.scheme
        rows, cols = entry.shape
        src = entry.source
        info = ckpt.tensor(src.tensor)
        after = sum(tensors[k]["data_offsets"][1] - tensors[k]["data_offsets"][0]
                    for k in entry.tensors())
        reports.append(ModuleReport(name, src.tensor, [rows, cols], s.label(),
                                    src.dtype or "?", info.nbytes, after,
                                    role=entry.role,
                                    aliases=sorted(a for a, o in qconfig.aliases.items() if o == name)))
    return Report(str(ckpt.path), "apply", reports, qconfig.tied,
                  overlay=str(ckpt.path / OVERLAY_NAME), warnings=notes)


def _check_scales(ovfile: Path, qconfig: OverlayConfig) -> None:
    """Refuse NaN/inf scales before the overlay becomes visible."""
    from safetensors import safe_open
    import torch
    with safe_open(str(ovfile), framework="pt") as f:
        for name in qconfig.modules:
            if not bool(torch.isfinite(f.get_tensor(f"{name}.weight_scale")).all()):
                raise OverlayError(f"{ovfile}: {name}.weight_scale holds NaN or infinite scales")


__all__ = ["apply_overlay", "check_base", "parse_bundle", "read_bundle"]
