"""The overlay an in-place commit replaces, kept by hard links until the new one is complete.

``quantize --force`` in place (or ``apply`` over an overlay) switches the committed overlay
off before the new one becomes visible (jobs/state.py's commit order): between the two a
loader reads the original model. Before that switch the old overlay's files are hard-linked
into ``.embedq/previous/`` (no data is copied, so a full disk does not stop it), with a
journal written last. A failure during the commit (a full disk, Ctrl-C, a read-only file)
puts them back by renames, which need no space; a kill leaves the folder, and the next
embedq run that takes the folder's lock (:func:`recover`) puts the old overlay back first,
unless the kill came after config.json's switch (the new overlay is complete and stays).
Either way the folder ends with the old overlay or the complete new one; between the kill
and that run, loaders may read the original model (config.json switched off) and
``embedq.load`` the new tables with their own settings (quantization_config.json), never
one overlay's settings over the other's tables. Without hard links (some filesystems)
nothing is kept and a failed commit leaves the original model.

``.embedq/`` may come from elsewhere (a download): a journal is used only while every file
it names is the very inode it recorded (device, inode, size; a copied folder has new
inodes), in ``previous/`` or already put back, and only the four files an overlay commit
changes are ever put back; anything else there is deleted unused, with a line saying so
(silently for a ``previous/`` without a journal: a run killed before anything was switched).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from pathlib import Path

from embedq.errors import OverlayError
from embedq.format import staging
from embedq.format.checkpoint import CONFIG_NAME, INDEX_NAME, OVERLAY_NAME, QCONFIG_NAME, STATE_DIR
from embedq.format.constants import QUANT_METHOD
from embedq.format.files import write_json_atomic

PREVIOUS = "previous"
JOURNAL = "journal.json"
# put back in this order: the new quantization_config.json goes first (so the old tables
# never sit beside it), config.json — the commit point — last
KEPT = (OVERLAY_NAME, QCONFIG_NAME, INDEX_NAME, CONFIG_NAME)
MAX_JSON_BYTES = 256 << 20  # as state.MAX_BACKUP_BYTES: a config.json may be large
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


def _json_file(p: Path):
    try:
        if p.is_symlink() or not p.is_file() or p.stat().st_size > MAX_JSON_BYTES:
            return None
        return json.loads(p.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None


def _ours(p: Path) -> bool:
    """A ``quantization_config.json`` of embedq's (another tool's is never removed)."""
    qc = _json_file(p)
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def _new_is_complete(path: Path, files: dict[str, list[int]]) -> bool:
    """Whether the commit got past its switch: config.json is not the kept one and names an
    embedq overlay (between the switch-off and the switch it is the original, naming none)."""
    try:
        if _ident(os.lstat(path / CONFIG_NAME)) == files.get(CONFIG_NAME) \
                or _ident(os.lstat(path / OVERLAY_NAME)) == files[OVERLAY_NAME]:
            return False
    except OSError:
        return False
    cfg = _json_file(path / CONFIG_NAME)
    named = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return isinstance(named, dict) and named.get("quant_method") == QUANT_METHOD


def _decide(path: Path) -> tuple[str, dict[str, list[int]] | None]:
    """What :func:`restore` would do here, and the journal's files (read only)."""
    d = _folder(path)
    if d.is_dir() and not d.is_symlink() and not os.path.lexists(d / JOURNAL):
        return "unchanged", None  # killed while keeping: nothing was switched yet
    files = _journal(d) if d.is_dir() and not d.is_symlink() else None
    if files is None:
        return "void", None
    if _new_is_complete(path, files):
        return "complete", files
    if all(os.path.lexists(path / n) and _ident(os.lstat(path / n)) == i for n, i in files.items()):
        return "unchanged", files  # killed before the switch began: the old overlay never went
    return "restore", files


def pending(path: Path) -> bool:
    """Whether a killed commit's old overlay waits in ``.embedq/previous/`` (read only)."""
    d = _folder(path)
    return (d.is_symlink() or d.exists()) and _decide(Path(path))[0] == "restore"


def restore(path: Path) -> str:
    """Put the kept overlay back by renames (idempotent; a test kill point after each).

    ``"restored"``; ``"complete"`` when the new overlay had been committed (it stays, the
    kept one is dropped); ``"unchanged"`` when nothing was switched yet; ``"void"`` for a
    journal that is not this folder's (dropped)."""
    path = Path(path)
    d = _folder(path)
    what, files = _decide(path)
    if what != "restore":
        discard(path)
        return what
    new_qc = path / QCONFIG_NAME
    if os.path.lexists(d / QCONFIG_NAME) and _ours(new_qc):
        new_qc.unlink()  # the new settings never sit beside the old tables
        staging.fsync_dir(path)
        staging.kill_point("committed")
    for name in KEPT:  # config.json, the switch, last
        if name in files and os.path.lexists(d / name) and _ident(os.lstat(d / name)) == files[name]:
            os.replace(d / name, path / name)
            staging.fsync_dir(path)
            staging.fsync_dir(d)
            staging.kill_point("committed")
    discard(path)
    return "restored"


def discard(path: Path) -> None:
    """Drop ``.embedq/previous/``: the journal first, so a half-removed folder is void."""
    d = _folder(path)
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):  # a link, file or FIFO in its place
        d.unlink()
        return
    j = d / JOURNAL
    try:
        if j.is_dir() and not j.is_symlink():
            shutil.rmtree(j)
        else:
            with contextlib.suppress(FileNotFoundError):
                j.unlink()
        staging.fsync_dir(d)
        shutil.rmtree(d)
    except (OSError, RecursionError) as e:  # one line naming the folder, not "unexpected"
        why = e.strerror if isinstance(e, OSError) and e.strerror else "nested too deep"
        raise OverlayError(f"{d}: cannot remove it ({why}); it is embedq's scratch space "
                           "(an interrupted run's earlier overlay): delete it by hand") from None


def recover(path: Path) -> bool:
    """At the start of a run holding the lock: put back an overlay a killed commit switched
    off (or keep the new one if it got past its switch); True when it was put back."""
    d = _folder(path)
    if not d.is_symlink() and not d.exists():
        return False
    what = restore(path)
    if what in ("complete", "unchanged"):
        return False
    note = ("the overlay it had switched off is back" if what == "restored" else
            "an interrupted run's earlier overlay, whose files are not this folder's own "
            "(copied or moved since?): not put back")
    staging.announce(Path(path), [f"{STATE_DIR}/{PREVIOUS}/ ({note})"])
    return what == "restored"
