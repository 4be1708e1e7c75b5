"""The overlay an in-place commit replaces, kept by hard links until the new one is complete.

``quantize --force`` in place (or ``apply`` over an overlay) switches the committed overlay
off before the new one becomes visible (jobs/state.py's commit order): between the two a
loader reads the original model. Before that switch the old overlay's files are hard-linked
into ``.embedq/previous/`` (no data is copied, so a full disk does not stop it), with a
journal written last. A failure during the commit (a full disk, Ctrl-C, a read-only file)
puts them back by renames, which need no space; a kill leaves the folder, and the next
embedq run that takes the folder's lock (:func:`recover`) puts the old overlay back first.
Either way the folder ends with the old overlay or the complete new one.

``.embedq/`` may come from elsewhere (a download): a journal is used only while every file
it names is the very inode it recorded (device, inode, size; a copied folder has new
inodes), and only the four files an overlay commit changes are ever put back.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from pathlib import Path

from embedq.format import staging
from embedq.format.checkpoint import CONFIG_NAME, INDEX_NAME, OVERLAY_NAME, QCONFIG_NAME, STATE_DIR
from embedq.format.constants import QUANT_METHOD
from embedq.format.files import write_json_atomic

PREVIOUS = "previous"
JOURNAL = "journal.json"
# put back in this order: the new quantization_config.json goes first (so the old tables
# never sit beside it), config.json — the commit point — last
KEPT = (OVERLAY_NAME, QCONFIG_NAME, INDEX_NAME, CONFIG_NAME)
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS)


def _folder(path: Path) -> Path:
    return Path(path) / STATE_DIR / PREVIOUS


def _ident(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size]


def _committed(path: Path) -> bool:
    """Whether a complete embedq overlay is visible here (config.json names it)."""
    try:
        cfg = json.loads((path / CONFIG_NAME).read_bytes())
        qc = json.loads((path / QCONFIG_NAME).read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    named = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return (isinstance(named, dict) and named.get("quant_method") == QUANT_METHOD
            and isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD
            and (path / OVERLAY_NAME).is_file())


def keep(path: Path) -> Path | None:
    """Hard-link the committed overlay's files into ``.embedq/previous/`` (journal last).

    None when no complete overlay is committed here, or the filesystem has no hard links
    (then a failed commit leaves the original model, as before this module).
    """
    path = Path(path)
    discard(path)  # recover() ran under the lock: anything still here is void
    if not _committed(path):
        return None
    d = _folder(path)
    d.mkdir()
    files = {}
    try:
        for name in KEPT:
            src = path / name
            if not src.is_symlink() and not src.exists():
                continue
            try:
                os.link(src, d / name, follow_symlinks=False)  # a link is kept as the link
            except OSError as e:
                if e.errno in _NO_LINKS:
                    discard(path)
                    return None
                raise
            files[name] = _ident(os.lstat(d / name))
        staging.fsync_dir(d)
        write_json_atomic(d / JOURNAL, {"format_version": 1, "files": files})
    except BaseException:
        discard(path)
        raise
    return d


def _journal(d: Path) -> dict[str, list[int]] | None:
    """The journal's files when every one is still the inode it recorded; else None."""
    try:
        fd = os.open(d / JOURNAL, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            raw = os.read(fd, 1 << 16)
        finally:
            os.close(fd)
        files = json.loads(raw)["files"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError):
        return None
    if not isinstance(files, dict) or not files or not set(files) <= set(KEPT) \
            or QCONFIG_NAME not in files or OVERLAY_NAME not in files:
        return None
    for name, ident in files.items():
        if not (isinstance(ident, list) and len(ident) == 3 and all(type(i) is int for i in ident)):
            return None
        for p in (d / name, d.parent.parent / name):  # kept, or already put back
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if _ident(st) == ident and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
                break
        else:
            return None
    return files


def _ours(p: Path) -> bool:
    """A ``quantization_config.json`` of embedq's (another tool's is never removed)."""
    try:
        if p.is_symlink() or not p.is_file() or p.stat().st_size > 1 << 20:
            return False
        qc = json.loads(p.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def restore(path: Path) -> bool:
    """Put the kept overlay back (renames, idempotent); True when it was."""
    path = Path(path)
    d = _folder(path)
    files = _journal(d) if d.is_dir() and not d.is_symlink() else None
    if files is None:
        discard(path)
        return False
    new_qc = path / QCONFIG_NAME
    if (d / QCONFIG_NAME).exists() and _ours(new_qc):
        new_qc.unlink()  # the new settings never sit beside the old tables
        staging.fsync_dir(path)
    for name in KEPT:
        if name in files and ((d / name).is_symlink() or (d / name).exists()):
            os.replace(d / name, path / name)
            staging.fsync_dir(path)
    discard(path)
    return True


def discard(path: Path) -> None:
    """Drop ``.embedq/previous/``: the journal first, so a half-removed folder is void."""
    d = _folder(path)
    if d.is_symlink() or d.is_file():
        d.unlink()
        return
    if not d.is_dir():
        return
    with contextlib.suppress(FileNotFoundError):
        (d / JOURNAL).unlink()
    staging.fsync_dir(d)
    shutil.rmtree(d)


def recover(path: Path) -> bool:
    """At the start of a run holding the lock: put back an overlay a killed commit switched off."""
    d = _folder(path)
    if not d.is_symlink() and not d.exists():
        return False
    if not restore(path):
        return False
    staging.announce(Path(path), [f"{STATE_DIR}/{PREVIOUS}/ (the overlay it had switched off is back)"])
    return True
