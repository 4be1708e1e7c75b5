"""``.embedq/previous/``, read only: the overlay a killed in-place re-commit switched off.

``jobs/previous.py`` keeps the committed overlay's files there (hard links, or copies where
the filesystem has none) with a journal of each kept file's identity (device, inode, size)
and of the original it was kept from. This module reads that state and decides — without
writing — what the next locked run will do: put the old overlay back (``"restore"``: the
folder is between two overlays, and every reader refuses it: :func:`check_settled`), keep
the new one (``"complete"``), or drop a stale or foreign journal. A journal is trusted only
for the very inodes it recorded (a downloaded or copied folder's are new).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from embedq.errors import OverlayError
from embedq.format.constants import (CONFIG_NAME, INDEX_NAME, LOCK_FILE, OVERLAY_NAME, QCONFIG_NAME,
                                     QUANT_METHOD, STATE_DIR, lock_pid)

PREVIOUS = "previous"
JOURNAL = "journal.json"
# put back in this order: the new quantization_config.json goes first (so the old tables
# never sit beside it), config.json — the commit point — last
KEPT = (OVERLAY_NAME, QCONFIG_NAME, INDEX_NAME, CONFIG_NAME)
MAX_JSON_BYTES = 256 << 20  # as state.MAX_BACKUP_BYTES: a config.json may be large


def folder(path: Path) -> Path:
    return Path(path) / STATE_DIR / PREVIOUS


def ident(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size]


def _idents(v) -> bool:
    return isinstance(v, dict) and set(v) <= set(KEPT) and all(
        isinstance(i, list) and len(i) == 3 and all(type(x) is int for x in i) for i in v.values())


def journal_of(d: Path) -> tuple[dict[str, list[int]], dict[str, list[int]]] | None:
    """The journal's kept files when every one is still the inode it recorded, and the
    originals' identities when they were kept (the same where hard-linked); else None."""
    try:  # reads only a regular file: never opens a FIFO (it would block) or a device
        if not stat.S_ISREG(os.lstat(d / JOURNAL).st_mode):
            return None
        fd = os.open(d / JOURNAL, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            raw = os.read(fd, 1 << 16)
        finally:
            os.close(fd)
        journal = json.loads(raw)
        files, live = journal["files"], journal.get("live", journal["files"])
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return None
    if not _idents(files) or not _idents(live) or set(live) != set(files) \
            or QCONFIG_NAME not in files or OVERLAY_NAME not in files:
        return None
    for name, want in files.items():
        for p in (d / name, d.parent.parent / name):  # kept, or already put back
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if ident(st) == want and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                break
        else:
            return None
    return files, live


def json_file(p: Path):
    try:
        if p.is_symlink() or not p.is_file() or p.stat().st_size > MAX_JSON_BYTES:
            return None
        return json.loads(p.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None


def ours(p: Path) -> bool:
    """A ``quantization_config.json`` of embedq's (another tool's is never removed)."""
    qc = json_file(p)
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def _new_is_complete(path: Path, live: dict[str, list[int]]) -> bool:
    """Whether the commit got past its switch: embedq.safetensors is not the one committed
    when the overlay was kept and config.json names an embedq overlay (between the switch-off
    and the switch it is the original, naming none). Not config.json's identity: kept by a
    copy, the original is freed at the switch-off and the new config.json may get its inode
    number back (ext4 does), size and all; the new tables' file was made while the old one
    still existed, so its number is never the old one's."""
    try:
        if ident(os.lstat(path / OVERLAY_NAME)) == live[OVERLAY_NAME]:
            return False
    except OSError:
        return False
    cfg = json_file(path / CONFIG_NAME)
    named = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return isinstance(named, dict) and named.get("quant_method") == QUANT_METHOD


def decide(path: Path) -> tuple[str, dict[str, list[int]] | None]:
    """What ``jobs.previous.restore`` would do here, and the journal's files (read only)."""
    d = folder(path)
    if d.is_dir() and not d.is_symlink() and not os.path.lexists(d / JOURNAL):
        return "unchanged", None  # killed while keeping: nothing was switched yet
    journal = journal_of(d) if d.is_dir() and not d.is_symlink() else None
    if journal is None:
        return "void", None
    files, live = journal
    if _new_is_complete(path, live):
        return "complete", files
    if all(os.path.lexists(path / n) and ident(os.lstat(path / n)) == i for n, i in live.items()):
        return "unchanged", files  # killed before the switch began: the old overlay never went
    return "restore", files


def pending(path: Path) -> bool:
    """Whether a killed commit's old overlay waits in ``.embedq/previous/`` (read only)."""
    d = folder(path)
    return (d.is_symlink() or d.exists()) and decide(Path(path))[0] == "restore"


def _committing(path: Path) -> str | None:
    """The live embedq run holding the folder's lock, as its lock file names it
    (:func:`~embedq.format.constants.lock_text`; emptied on release, a killed holder's pid is
    dead); read only: taking the lock, even shared for a moment, could refuse that run's own start."""
    try:
        with open(Path(path) / STATE_DIR / LOCK_FILE, "rb", opener=_nofollow) as f:
            holder = f.read(200).decode("utf-8", "replace").strip()
        pid = lock_pid(holder)
        if pid is None:
            return None
        os.kill(pid, 0)
    except OSError:
        return None
    return holder


def _nofollow(p, flags):
    return os.open(p, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)


def check_settled(path: Path) -> None:
    """Refuse a folder a killed re-commit left between two overlays: its tables and its
    config.json belong to different ones until the next locked embedq run settles it."""
    if pending(path):
        holder = _committing(path)
        if holder is not None:
            raise OverlayError(f"{path}: another embedq run is committing a new overlay here ({holder}); "
                               "wait for it to finish")
        raise OverlayError(
            f"{path}: an interrupted `quantize --force` / `apply --force` left this folder between two "
            f"overlays (the earlier one waits in {STATE_DIR}/{PREVIOUS}/); rerun that command, or any "
            "embedq quantize/apply/remove here to put the earlier one back")
