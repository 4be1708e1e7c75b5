"""In-place overlay state: backups, the commit sequence, the folder lock, ``embedq remove``.

Commit order (config.json is the commit point):
1. originals of config.json and the index are copied to ``.embedq/`` (once, before
   the first change; ``state.json`` written last marks the backup complete);
2. the finished overlay is renamed to ``embedq.safetensors``;
3. ``quantization_config.json``, then the index, then ``config.json`` are replaced
   atomically.
An overlay committed earlier is switched off first (its ``quantization_config.json``
removed, then config.json back to the original), so a crash anywhere leaves the old
overlay (before that switch), the original config.json (the overlay is invisible to
loaders) or the complete new overlay. The old overlay's files are hard-linked (or copied) into
``.embedq/previous/`` before the switch (jobs/previous.py): a failure puts them back at
once, and after a kill before config.json's switch the next run that takes the folder's
lock does (after it, the new overlay is complete and stays).

A downloaded folder may carry a ``.embedq/`` of its own, so nothing in it is trusted
blindly (docs/security.md): ``state.json`` may name only the two files embedq backs up,
backups are read without following links, and a backup is used only while it matches
what is on disk (the config as backed up, or as embedq edited it); a stale one is never
restored. Jobs that change a folder hold :func:`folder_lock` (``.embedq/lock``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
from pathlib import Path

from embedq.errors import OverlayError
from embedq.format.constants import LOCK_FILE, QUANT_METHOD, lock_text
from embedq.format.checkpoint import (CONFIG_NAME, INDEX_NAME, OVERLAY_NAME, QCONFIG_NAME,
                                        STATE_DIR, Checkpoint)
from embedq.format import staging
from embedq.format.files import inside, stays_inside, write_bytes_atomic, write_json_atomic
from embedq.jobs import previous, testpoint

STATE_FILE = "state.json"
BACKED_UP = (CONFIG_NAME, INDEX_NAME)  # the only files embedq ever backs up and restores
MAX_BACKUP_BYTES = 256 << 20


def _state_dir(path: Path) -> Path:
    d = Path(path) / STATE_DIR
    if d.is_symlink() or (d.exists() and not d.is_dir()):
        raise OverlayError(f"{d}: a link or a file, not the state folder embedq makes; refusing to use it "
                           "(delete it if this folder came from elsewhere)")
    return d


def _read_nofollow(p: Path) -> bytes:
    """Bytes of a regular file, never through a link (nor a FIFO: O_NONBLOCK opens one
    without waiting for a writer, and fstat refuses it)."""
    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BACKUP_BYTES:
            raise OverlayError(f"{p}: not a backup embedq wrote (not a regular file or too large)")
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _load_state(d: Path) -> dict | None:
    """The validated ``state.json``; None when there is none (no complete backup)."""
    sp = d / STATE_FILE
    try:
        raw = _read_nofollow(sp)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OverlayError(f"{sp}: a link, not a state file embedq wrote; refusing") from None
        raise
    try:
        st = json.loads(raw)
    except (ValueError, RecursionError):
        raise OverlayError(f"{sp}: not valid JSON; not a backup embedq wrote (delete {d} to start over)") from None
    files = st.get("files") if isinstance(st, dict) else None
    if not isinstance(files, list) or not files or any(f not in BACKED_UP for f in files) \
            or len(set(files)) != len(files) or CONFIG_NAME not in files:
        shown = str(files)[:80]
        raise OverlayError(f"{sp}: lists {shown}; embedq backs up only {', '.join(BACKED_UP)}; "
                           f"refusing to restore from it (delete {d} if this folder came from elsewhere)")
    links = st.get("links") or {}
    if not isinstance(links, dict) or any(k not in files or not isinstance(v, str) or "\0" in v
                                          for k, v in links.items()):
        raise OverlayError(f"{sp}: malformed links; not a backup embedq wrote")
    return {"files": files, "links": links}


def read_backup(path: Path) -> dict[str, bytes] | None:
    """Original bytes of config.json (and index) saved before the first overlay.

    Only ``config.json`` and the index, read without following links; a ``state.json``
    naming anything else raises :class:`OverlayError`.
    """
    d = _state_dir(path)
    st = _load_state(d)
    if st is None:
        return None
    out = {}
    for name in st["files"]:
        try:
            out[name] = _read_nofollow(d / name)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise OverlayError(f"{d / name}: a link, not a backup embedq wrote; refusing") from None
            raise
    return out


def _links(path: Path) -> dict[str, str]:
    d = _state_dir(path)
    st = _load_state(d)
    return dict(st["links"]) if st else {}


def _json(data: bytes):
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def stale_reason(path: Path, backup: dict[str, bytes]) -> str | None:
    """Why ``backup`` does not belong to the files on disk (None: it does).

    It belongs when config.json is the backed-up one, or that one with an embedq
    ``quantization_config`` set (and likewise the index, up to the overlay's entries).
    """
    path = Path(path)
    orig = _json(backup[CONFIG_NAME])
    try:
        disk = _json(inside(path, CONFIG_NAME).read_bytes())
    except FileNotFoundError:
        return f"{CONFIG_NAME} is gone"
    if not isinstance(orig, dict) or not isinstance(disk, dict):
        return f"{CONFIG_NAME} or its backup is not a JSON object"
    if disk != orig:
        qc = disk.get("quantization_config")
        rest = {k: v for k, v in disk.items() if k != "quantization_config"}
        orest = {k: v for k, v in orig.items() if k != "quantization_config"}
        if not (isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD and rest == orest):
            return f"{CONFIG_NAME} was changed after embedq backed it up"
    has_index = (path / INDEX_NAME).exists()
    if (INDEX_NAME in backup) != has_index:
        return f"{INDEX_NAME} was {'added' if has_index else 'removed'} after embedq backed up"
    if has_index:
        oi, di = _json(backup[INDEX_NAME]), _json(inside(path, INDEX_NAME).read_bytes())
        if not isinstance(oi, dict) or not isinstance(oi.get("weight_map"), dict) or not isinstance(di, dict):
            return f"{INDEX_NAME} or its backup has no weight_map"
        if di != oi:
            wm = di.get("weight_map")
            if not isinstance(wm, dict):
                return f"{INDEX_NAME} has no weight_map"
            dwm = {k: v for k, v in wm.items() if v != OVERLAY_NAME}
            dmeta = {k: v for k, v in di.items() if k != "weight_map"}
            ometa = {k: v for k, v in oi.items() if k != "weight_map"}
            if dwm != oi["weight_map"] or dmeta != ometa:
                return f"{INDEX_NAME} was changed after embedq backed it up"
    return None


def valid_backup(path: Path) -> tuple[dict[str, bytes] | None, str | None]:
    """``(backup, None)`` for a backup matching the disk; ``(None, reason)`` for a stale one."""
    backup = read_backup(path)
    if backup is None:
        return None, None
    why = stale_reason(path, backup)
    return (None, why) if why else (backup, None)


def write_backup(path: Path) -> dict[str, bytes]:
    d = _state_dir(path)
    try:
        d.mkdir(exist_ok=True)
        (d / STATE_FILE).unlink(missing_ok=True)  # an old, stale backup is void from here on
        files = [CONFIG_NAME] + ([INDEX_NAME] if (path / INDEX_NAME).exists() else [])
        saved, links = {}, {}
        for name in files:
            src = inside(path, name)
            if src.is_symlink():  # a HF cache snapshot: restored as the same link
                links[name] = os.readlink(src)
            data = src.read_bytes()
            write_bytes_atomic(d / name, data)
            saved[name] = data
        for name in BACKED_UP:
            if name not in files:
                (d / name).unlink(missing_ok=True)
        st = {"files": files, "format_version": 1}
        if links:
            st["links"] = links
        write_json_atomic(d / STATE_FILE, st)
    except BaseException:
        _drop_incomplete_state(d, keep_lock=True)  # no half backup (or empty .embedq/) left
        raise
    return saved


def _drop_incomplete_state(d: Path, keep_lock: bool = False) -> None:
    """Remove a ``.embedq/`` that holds no complete backup (nothing else of ours in it)."""
    if (d / STATE_FILE).exists() or d.is_symlink() or not d.is_dir():
        return
    for p in d.iterdir():
        if p.name in BACKED_UP or (p.name == LOCK_FILE and not keep_lock) or staging.leftover(p.name):
            with contextlib.suppress(OSError):
                p.unlink()
    with contextlib.suppress(OSError):
        d.rmdir()  # only if empty: files we did not write stay


def cleanup_partials(path: Path) -> list[Path]:
    """Delete temporary files an interrupted embedq run left behind (here and in
    ``.embedq/``): the caller holds the folder lock, so no live run owns any of them."""
    gone = []
    d = path / STATE_DIR
    for folder in (path, d) if d.is_dir() and not d.is_symlink() else (path,):
        gone += [folder / n for n in staging.clean_leftovers(folder)]
    return gone


def _restore_one(path: Path, name: str, data: bytes, link: str | None) -> None:
    target = path / name
    if link is not None:
        dest = (path / link) if not os.path.isabs(link) else Path(link)
        try:  # a link state.json records is recreated only where reads may go (blobs/)
            same = stays_inside(path, dest) and dest.is_file() and dest.read_bytes() == data
        except OSError:
            same = False
        if same:  # recreate the link (e.g. to a HF cache blob); never write through it
            if target.is_symlink() and os.readlink(target) == link:
                return
            tmp = staging.partial_path(target)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            os.symlink(link, tmp)
            os.replace(tmp, target)
            staging.fsync_dir(path)
            return
    if target.is_symlink() or not target.exists() or inside(path, name).read_bytes() != data:
        write_bytes_atomic(target, data)


def _restore(path: Path, backup: dict[str, bytes], links: dict[str, str] | None = None) -> None:
    links = links or {}
    for name, data in backup.items():  # if this fails the backup stays: it is still needed
        if name not in BACKED_UP:  # read_backup never yields another name; belt and braces
            raise OverlayError(f"{path / STATE_DIR}: refusing to restore {name!r}")
        _restore_one(path, name, data, links.get(name))
    try:  # config.json is the original again: whatever happens now, no state is left behind
        for name in (OVERLAY_NAME, QCONFIG_NAME):
            if _ours(path, name):
                (path / name).unlink(missing_ok=True)
    finally:
        d = path / STATE_DIR
        if d.is_dir() and not d.is_symlink():
            shutil.rmtree(d, ignore_errors=True)
        cleanup_partials(path)


def _ours(path: Path, name: str) -> bool:
    """Whether ``path/name`` (the overlay or its config) is a file embedq may delete: a
    regular file or a link staying in the folder (a link out of it is never embedq's), and for
    ``quantization_config.json`` one whose quant_method is embedq's (another tool's file of
    that name is never touched)."""
    p = path / name
    if not p.is_symlink() and not p.is_file():
        return False  # absent, or a folder someone else made
    if p.is_symlink() and not stays_inside(path, p):
        return False  # a link out of the folder: not embedq's (check_slots refuses it)
    if name != QCONFIG_NAME:
        return True
    try:  # read only inside the folder (a HF snapshot's link to its blob is fine)
        if not stays_inside(path, p) or not p.is_file() or p.stat().st_size > MAX_BACKUP_BYTES:
            return False
        qc = _json(p.read_bytes())
    except OSError:
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def check_slots(path: Path) -> None:
    """Refuse, before anything is written, a folder whose ``embedq.safetensors`` or
    ``quantization_config.json`` is not embedq's to replace: a folder, a link out of the
    model folder, or (the config) another tool's file, which an overlay would destroy."""
    for name in (OVERLAY_NAME, QCONFIG_NAME):
        p = path / name
        if not p.is_symlink() and not p.exists():
            continue
        if p.is_symlink() and not stays_inside(path, p):
            problem = "a link out of the folder"
        elif p.is_symlink() and not p.exists():
            continue  # a broken link inside the folder: it holds nothing; the commit replaces it
        elif not p.is_file():
            problem = "not a regular file (a folder?)"
        elif name == QCONFIG_NAME and not _ours(path, name):
            problem = "not embedq's (no quant_method \"embedq\"); an overlay would overwrite it"
        else:
            continue
        raise OverlayError(f"{p}: {problem}; move it out of {path} first, or work on a copy "
                           "(embedq quantize --output DIR, or apply to a copy of the model)")


def commit_in_place(ckpt: Checkpoint, writer, qconfig: dict) -> None:
    """Make a finished overlay visible: the commit sequence of this module's docstring."""
    path = ckpt.path
    check_slots(path)  # base_state checked; the folder may have changed while we streamed
    backup, _ = valid_backup(path)
    if backup is None:  # none, or a stale one (base_state warned): back up what is on disk now
        backup = write_backup(path)
    links = _links(path)
    kept = previous.keep(path)  # the committed overlay, hard-linked or copied: put back if this fails
    try:
        # an overlay committed earlier (quantize --force, apply over an overlay) is switched
        # off first: its quantization_config.json goes (config.json still names the old
        # tables), then config.json is the original again. A kill after the rename below then
        # leaves the original model beside the new tables, never the old settings over them
        # (embedq.load pairs quantization_config.json with embedq.safetensors), until the
        # next run puts the kept overlay back (previous.recover)
        if _ours(path, QCONFIG_NAME):
            (path / QCONFIG_NAME).unlink()
            staging.fsync_dir(path)
            testpoint.reached("committing")
        _restore_one(path, CONFIG_NAME, backup[CONFIG_NAME], links.get(CONFIG_NAME))
        writer.commit()
        testpoint.reached("committing")
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
        if kept is None:
            _restore(path, backup, links)
        else:  # the old overlay again, by renames (a full disk cannot stop them)
            with contextlib.suppress(OSError, OverlayError):  # else the next run recovers
                previous.restore(path)
                cleanup_partials(path)
        raise
    if kept is not None:
        with contextlib.suppress(OSError, OverlayError):  # complete: the kept one is void
            previous.discard(path)


@contextlib.contextmanager
def folder_lock(path: str | os.PathLike, what: str):
    """Hold the advisory lock of a model folder (``.embedq/lock``, ``fcntl.flock``).

    A second run on the same folder fails at once, naming the process that holds it.
    A ``.embedq/`` created only for the lock is removed again on the way out.
    """
    p = Path(path)
    d = _state_dir(p)
    try:
        d.mkdir(exist_ok=True)
    except OSError as e:
        raise OverlayError(f"{p}: folder is not writable ({e.strerror or e})") from None
    lp = d / LOCK_FILE
    while True:
        try:
            fd = os.open(lp, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            _drop_incomplete_state(d)
            if e.errno == errno.ELOOP:
                raise OverlayError(f"{lp}: a link, not embedq's lock file; refusing") from None
            raise OverlayError(f"{p}: folder is not writable ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise OverlayError(f"{p}: another embedq run is working on this folder ({holder}); "
                               "wait for it to finish") from None
        try:  # the lock file may have been removed (a finished remove) while we waited
            same = os.stat(lp, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
        d.mkdir(exist_ok=True)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, lock_text(os.getpid(), what).encode(), 0)
    except OSError:
        pass
    try:
        previous.recover(p)  # a killed in-place commit: its old overlay is back first
        yield
    finally:
        try:
            if d.is_dir() and not (d / STATE_FILE).exists():
                _drop_incomplete_state(d)
            else:  # an empty lock file stays with the backup: the folder reads the same after
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
        finally:
            os.close(fd)


def remove_overlay(path: str | os.PathLike) -> list[str]:
    """Remove an in-place overlay, restoring config.json and the index byte for byte."""
    p = Path(path)
    if not (p / CONFIG_NAME).exists():
        raise OverlayError(f"{p / CONFIG_NAME}: no config.json (is this a model folder?)")
    with folder_lock(p, "remove"):
        return _remove(p)


def _remove(p: Path) -> list[str]:
    backup, stale = valid_backup(p)
    if stale:
        raise OverlayError(f"{p / STATE_DIR}: the backup there does not match this folder ({stale}); "
                           f"not restoring it. The newer files are kept; delete {p / STATE_DIR} "
                           f"(and {OVERLAY_NAME}/{QCONFIG_NAME} if no longer wanted) by hand")
    if backup is None:
        try:
            cfg = json.loads(inside(p, CONFIG_NAME).read_text())
        except (ValueError, RecursionError):
            cfg = {}
        qc = (cfg.get("quantization_config") if isinstance(cfg, dict) else None) or {}
        if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD:
            raise OverlayError(f"{p}: embedq-derived checkpoint (no original to restore); "
                               "delete the folder or use its source")
        stray = [n for n in (OVERLAY_NAME, QCONFIG_NAME) if _ours(p, n)] + \
            [x.name for x in p.iterdir() if staging.leftover(x.name)]
        if not stray:
            kept = f" ({QCONFIG_NAME} there is not embedq's; left alone)" \
                if (p / QCONFIG_NAME).exists() or (p / QCONFIG_NAME).is_symlink() else ""
            raise OverlayError(f"{p}: no embedq overlay to remove{kept}")
        for n in (OVERLAY_NAME, QCONFIG_NAME):
            if n in stray:
                (p / n).unlink(missing_ok=True)
        cleanup_partials(p)
        return stray
    restored = sorted(backup)
    _restore(p, backup, _links(p))
    return restored


def base_state(ckpt: Checkpoint, force: bool = False, derived: bool = False,
               warnings: list[str] | None = None) -> dict | None:
    """Undo a previous overlay in memory; return the original quantization_config.

    ``derived``: the result goes to another folder, so an existing overlay here is not
    replaced and needs no ``force``. A stale backup (the files changed since) is
    ignored, with a line in ``warnings``; the next commit backs up the current files.
    """
    if not derived:
        check_slots(ckpt.path)
    qc = ckpt.existing_quantization_config()
    backup, stale = valid_backup(ckpt.path)
    if stale and warnings is not None:
        warnings.append(f"{ckpt.path / STATE_DIR}: ignored a stale backup ({stale}); "
                        f"the current {CONFIG_NAME} is what `embedq remove` will restore")
    if isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD:
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
