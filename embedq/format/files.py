"""Small atomic file operations shared by the overlay writers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from embedq.errors import OverlayError
from embedq.format.writer import fsync_dir


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary name, fsync and rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise OverlayError(f"{path}: cannot write: {e.strerror or e}") from e


def write_json_atomic(path: Path, obj) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2) + "\n").encode())


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (same bytes, no space); copy across filesystems.

    A symlinked ``src`` (a Hugging Face cache snapshot, whose files link into ``blobs/``)
    is resolved first: ``dst`` is then a real file, never a link that a later write could
    go through into the shared blob (``os.link`` on a symlink links the symlink itself).
    """
    src = Path(os.path.realpath(src))
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def link_checkpoint(src: Path, dst: Path) -> Path:
    """A working copy of a checkpoint folder: weight shards hard-linked (embedq never
    writes source shards), other files copied, dotfiles (embedq state) left out."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not f.is_file() or f.name.startswith("."):
            continue
        if f.suffix == ".safetensors":
            link_or_copy(f, dst / f.name)
        else:
            shutil.copy2(f, dst / f.name)
    return dst


def check_writable(path: Path) -> None:
    """Fail early, naming the folder, if nothing can be created in it."""
    if not os.access(path, os.W_OK | os.X_OK):
        raise OverlayError(f"{path}: folder is not writable")
    probe = path / f".embedq-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OverlayError(f"{path}: folder is not writable ({e.strerror or e})") from None
