"""The overlay an in-place commit replaces, kept until the new one is complete.

``quantize --force`` in place (or ``apply`` over an overlay) switches the committed overlay
off before the new one becomes visible (jobs/state.py's commit order): between the two a
loader reads the original model. Before that switch the old overlay's files are hard-linked
into ``.embedq/previous/`` (no data is copied, so a full disk does not stop it), with a
journal written last (its reading: ``format/kept.py``). Where the filesystem has no hard
links (exFAT, some FUSE and network mounts) they are copied instead; a copy that does not
fit refuses the commit before anything is switched (the old overlay stays). With ``.embedq/``
on another mount (EXDEV) nothing is kept: no rename could put a copy back, and a failed
commit leaves the original model. A failure
during the commit (a full disk, Ctrl-C, a read-only file) puts them back by renames, which
need no space; a kill leaves the folder, and the next embedq run that takes the folder's
lock (:func:`recover`) puts the old overlay back first, unless the kill came after
config.json's switch (the new overlay is complete and stays). Either way the folder ends
with the old overlay or the complete new one; between the kill and that run, loaders of
config.json read the original model, and every embedq reader refuses the folder
(``kept.check_settled``): its tables are the new ones, its config.json the original.

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
from embedq.format import kept, staging
from embedq.format.checkpoint import CONFIG_NAME, OVERLAY_NAME, QCONFIG_NAME, STATE_DIR
from embedq.format.constants import QUANT_METHOD
from embedq.format.files import write_json_atomic

_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS)
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _committed(path: Path) -> bool:
    """Whether a complete embedq overlay is visible here (config.json names it)."""
    def read(p: Path):  # regular files only (a FIFO would block), links followed (HF snapshots)
        if not p.is_file() or p.stat().st_size > kept.MAX_JSON_BYTES:
            raise ValueError(p)
        return json.loads(p.read_bytes())
    try:
        cfg, qc = read(path / CONFIG_NAME), read(path / QCONFIG_NAME)
    except (OSError, ValueError, RecursionError):
        return False
    named = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return (isinstance(named, dict) and named.get("quant_method") == QUANT_METHOD
            and isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD
            and (path / OVERLAY_NAME).is_file())


def _copy(src: Path, dst: Path) -> None:
    """``src`` as a new file ``dst`` (a symlink as the same link), fsynced: where hard links fail."""
    try:
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
            return
        shutil.copyfile(src, dst, follow_symlinks=False)
        staging.fsync_file(dst)
    except OSError as e:
        if e.errno in _FULL:
            raise OverlayError(
                f"{src.parent}: no room to keep the current overlay while the new one is committed "
                f"({os.strerror(e.errno)}; this filesystem has no hard links, so its "
                f"{_bytes(src.parent)} are copied first): free that much space, or run "
                "`embedq remove` on the folder first (the old overlay is unchanged)") from None
        raise


def _bytes(path: Path) -> str:
    n = sum(os.lstat(path / k).st_size for k in kept.KEPT if os.path.lexists(path / k))
    return f"{n / 1e6:.1f} MB"


def keep(path: Path) -> Path | None:
    """Keep the committed overlay's files in ``.embedq/previous/`` (journal last): hard links,
    or copies on a filesystem without them (an OverlayError, nothing switched, if a copy does
    not fit). None when no complete overlay is committed here.
    """
    path = Path(path)
    discard(path)  # recover() ran under the lock: anything still here is void
    if not _committed(path):
        return None
    d = kept.folder(path)
    d.mkdir()
    files, live = {}, {}
    linked = True
    try:
        for name in kept.KEPT:
            src = path / name
            if not src.is_symlink() and not src.exists():
                continue
            live[name] = kept.ident(os.lstat(src))
            if linked:
                try:
                    os.link(src, d / name, follow_symlinks=False)  # a link is kept as the link
                except OSError as e:
                    if e.errno == errno.EXDEV:  # .embedq/ on another mount: no rename could put a
                        discard(path)          # copy back; nothing is kept (a failure leaves the original)
                        return None
                    if e.errno not in _NO_LINKS:
                        raise
                    linked = False
            if not linked:
                _copy(src, d / name)
            files[name] = kept.ident(os.lstat(d / name))
        staging.fsync_dir(d)
        write_json_atomic(d / kept.JOURNAL, {"format_version": 1, "files": files, "live": live})
    except BaseException:
        discard(path)
        raise
    return d


def restore(path: Path) -> str:
    """Put the kept overlay back by renames (idempotent; a test kill point after each).

    ``"restored"``; ``"complete"`` when the new overlay had been committed (it stays, the
    kept one is dropped); ``"unchanged"`` when nothing was switched yet; ``"void"`` for a
    journal that is not this folder's (dropped)."""
    path = Path(path)
    d = kept.folder(path)
    what, files = kept.decide(path)
    if what != "restore":
        discard(path)
        return what
    new_qc = path / QCONFIG_NAME
    if os.path.lexists(d / QCONFIG_NAME) and kept.ident(os.lstat(d / QCONFIG_NAME)) == files[QCONFIG_NAME] \
            and kept.ours(new_qc):  # only while the recorded old one waits to replace it
        new_qc.unlink()  # the new settings never sit beside the old tables
        staging.fsync_dir(path)
        staging.kill_point("committed")
    for name in kept.KEPT:  # config.json, the switch, last
        if name in files and os.path.lexists(d / name) and kept.ident(os.lstat(d / name)) == files[name]:
            os.replace(d / name, path / name)
            staging.fsync_dir(path)
            staging.fsync_dir(d)
            staging.kill_point("committed")
    discard(path)
    return "restored"


def discard(path: Path) -> None:
    """Drop ``.embedq/previous/``: the journal first, so a half-removed folder is void."""
    d = kept.folder(path)
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):  # a link, file or FIFO in its place
        d.unlink()
        return
    j = d / kept.JOURNAL
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
    d = kept.folder(path)
    if not d.is_symlink() and not d.exists():
        return False
    what = restore(path)
    if what in ("complete", "unchanged"):
        return False
    note = ("the overlay it had switched off is back" if what == "restored" else
            "an interrupted run's earlier overlay, whose files are not this folder's own "
            "(copied or moved since?): not put back")
    staging.announce(Path(path), [f"{STATE_DIR}/{kept.PREVIOUS}/ ({note})"])
    return what == "restored"
