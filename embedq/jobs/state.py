"""In-place overlay state: backups, the commit sequence, and ``embedq remove``.

Commit order (config.json is the commit point):
1. originals of config.json and the index are copied to ``.embedq/`` (once, before
   the first change; ``state.json`` written last marks the backup complete);
2. the finished overlay is renamed to ``embedq.safetensors``;
3. ``quantization_config.json``, then the index, then ``config.json`` are replaced
   atomically.
A crash anywhere leaves either the original config.json (the overlay is invisible
to loaders, and the next run or ``remove`` cleans up) or a complete overlay.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from embedq.errors import OverlayError
from embedq.format.constants import QUANT_METHOD
from embedq.format.checkpoint import (CONFIG_NAME, INDEX_NAME, OVERLAY_NAME, QCONFIG_NAME,
                                        STATE_DIR, Checkpoint)
from embedq.format.files import write_bytes_atomic, write_json_atomic

STATE_FILE = "state.json"


def read_backup(path: Path) -> dict[str, bytes] | None:
    """Original bytes of config.json (and index) saved before the first overlay."""
    d = Path(path) / STATE_DIR
    try:
        st = json.loads((d / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    out = {}
    for name in st.get("files", []):
        try:
            out[name] = (d / name).read_bytes()
        except FileNotFoundError:
            return None
    return out if CONFIG_NAME in out else None


def write_backup(path: Path) -> dict[str, bytes]:
    d = path / STATE_DIR
    d.mkdir(exist_ok=True)
    files = [CONFIG_NAME] + ([INDEX_NAME] if (path / INDEX_NAME).exists() else [])
    saved = {}
    for name in files:
        data = (path / name).read_bytes()
        write_bytes_atomic(d / name, data)
        saved[name] = data
    write_json_atomic(d / STATE_FILE, {"files": files, "format_version": 1})
    return saved


def cleanup_partials(path: Path) -> list[Path]:
    """Delete temporary files an interrupted embedq run left behind."""
    gone = []
    for p in list(path.glob(".*.partial")) + list((path / STATE_DIR).glob(".*.partial")):
        try:
            p.unlink()
            gone.append(p)
        except OSError:
            pass
    return gone


def _restore(path: Path, backup: dict[str, bytes]) -> None:
    for name, data in backup.items():
        target = path / name
        if not target.exists() or target.read_bytes() != data:
            write_bytes_atomic(target, data)
    for name in (OVERLAY_NAME, QCONFIG_NAME):
        try:
            (path / name).unlink()
        except FileNotFoundError:
            pass
    shutil.rmtree(path / STATE_DIR, ignore_errors=True)
    cleanup_partials(path)


def commit_in_place(ckpt: Checkpoint, writer, qconfig: dict) -> None:
    """Make a finished overlay visible: the commit sequence of this module's docstring."""
    path = ckpt.path
    backup = read_backup(path) or write_backup(path)
    try:
        writer.commit()
        write_json_atomic(path / QCONFIG_NAME, qconfig)
        if INDEX_NAME in backup:
            index = json.loads(backup[INDEX_NAME])
            wm = {k: v for k, v in index["weight_map"].items() if v != OVERLAY_NAME}
            for name in writer.sizes:
                wm[name] = OVERLAY_NAME
            index["weight_map"] = wm
            write_json_atomic(path / INDEX_NAME, index)
        config = json.loads(backup[CONFIG_NAME])
        config["quantization_config"] = qconfig
        write_json_atomic(path / CONFIG_NAME, config)
    except BaseException:
        _restore(path, backup)
        raise


def remove_overlay(path: str | os.PathLike) -> list[str]:
    """Remove an in-place overlay, restoring config.json and the index byte for byte."""
    p = Path(path)
    if not (p / CONFIG_NAME).exists():
        raise OverlayError(f"{p / CONFIG_NAME}: no config.json (is this a model folder?)")
    backup = read_backup(p)
    if backup is None:
        try:
            cfg = json.loads((p / CONFIG_NAME).read_text())
        except json.JSONDecodeError:
            cfg = {}
        qc = cfg.get("quantization_config") or {}
        if qc.get("quant_method") == QUANT_METHOD:
            raise OverlayError(f"{p}: embedq-derived checkpoint (no original to restore); "
                               "delete the folder or use its source")
        stray = [n for n in (OVERLAY_NAME, QCONFIG_NAME) if (p / n).exists()] + \
            [x.name for x in p.glob(".*.partial")]
        if not stray:
            raise OverlayError(f"{p}: no embedq overlay to remove")
        for n in (OVERLAY_NAME, QCONFIG_NAME):
            (p / n).unlink(missing_ok=True)
        cleanup_partials(p)
        return stray
    restored = sorted(backup)
    _restore(p, backup)
    return restored


def base_state(ckpt: Checkpoint, force: bool = False, derived: bool = False) -> dict | None:
    """Undo a previous overlay in memory; return the original quantization_config.

    ``derived``: the result goes to another folder, so an existing overlay here is not
    replaced and needs no ``force``.
    """
    qc = ckpt.existing_quantization_config()
    backup = read_backup(ckpt.path)
    if qc and qc.get("quant_method") == QUANT_METHOD:
        if backup is None:
            what = "already an embedq-derived checkpoint; use its source" if derived else (
                "already quantized by embedq and no original is recorded "
                "(a derived checkpoint?); quantize its source instead")
            raise OverlayError(f"{ckpt.path}: {what}")
        if not force and not derived:
            raise OverlayError(f"{ckpt.path}: already has an embedq overlay; "
                               "pass --force to replace it or run `embedq remove` first")
    if backup is not None:
        # The original config (and index) as they were before any embedq run.
        ckpt.config = json.loads(backup[CONFIG_NAME])
        qc = ckpt.existing_quantization_config()
    return qc
