"""Which files of a model folder embedq may read, and small atomic file operations."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

from embedq.errors import OverlayError, UnsafePathError


# --------------------------------------------------------------------------- reading
# A downloaded folder is untrusted: a file it names (an index's shard, an ONNX graph's
# external data) or a link it holds could otherwise make embedq read another model's
# weights, or any file, and write them into an overlay that gets published.


def read_json(path: str | os.PathLike, error: type = OverlayError, *, max_bytes: int | None = None,
              what: str = "JSON file", missing: str = "not found", constants: bool = False):
    """The one JSON reader: ``path``'s JSON value; a missing file, a folder, a file over
    ``max_bytes``, invalid JSON or (unless ``constants``) a NaN/Infinity constant raise
    ``error`` naming ``path``."""
    p = Path(path)
    try:
        # O_NONBLOCK: a FIFO (or a device) at the name opens without waiting for a writer and is
        # refused below, where a plain open() waited forever (regular files ignore the flag)
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError
            if not stat.S_ISREG(mode):
                raise error(f"{p}: not a regular file (a FIFO, device or socket); refusing to read it")
            data = f.read() if max_bytes is None else f.read(max_bytes)
            if max_bytes is not None and f.read(1):
                raise error(f"{p}: too large for a {what}")
        return json.loads(data, parse_constant=None if constants else _no_constant)
    except FileNotFoundError:
        raise error(f"{p}: {missing}") from None
    except IsADirectoryError:
        raise error(f"{p}: a folder, not a JSON file") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, NaN, nesting
        raise error(f"{p}: not valid JSON ({str(e).splitlines()[0][:120]})") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def inspect_target(spec: str | os.PathLike) -> str:
    """What ``inspect`` was given, by content: ``"gguf"`` (a file starting ``GGUF``, or a
    missing ``*.gguf``, which the GGUF reader names) or ``"checkpoint"`` (a folder or a Hub
    id); any other file raises one ``CheckpointError`` saying what it is."""
    from embedq.errors import CheckpointError
    p = Path(spec)
    if not p.is_file():
        return "gguf" if str(spec).endswith(".gguf") and not p.exists() else "checkpoint"
    try:
        with open(p, "rb") as f:
            head = f.read(16)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read it ({e.strerror or e})") from None
    if head[:4] == b"GGUF":
        return "gguf"
    if len(head) >= 9 and head[8:9] == b"{":  # a safetensors header: u64 length, then JSON
        what = "a safetensors file"
    elif head.lstrip()[:1] in (b"{", b"["):
        what = "a JSON file"
    else:
        what = f"not a GGUF file (it starts {head[:4]!r}, GGUF files start b'GGUF')"
    raise CheckpointError(f"{p}: {what}: give the model's folder, a Hub id or a llama.cpp .gguf file")


def read_roots(folder: Path) -> list[Path]:
    """Where files read on behalf of ``folder`` may resolve: the folder itself and, for a
    Hugging Face cache snapshot (``models--o--n/snapshots/<rev>[/sub]``, seen through the
    path given or through its resolved location), that repository's ``blobs/``."""
    folder = Path(folder)
    real = folder.resolve()
    roots = [real]
    for f in (folder, real):
        for d in (f, *f.parents):
            if d.parent.name == "snapshots" and d.parent.parent != d.parent:
                blobs = (d.parent.parent / "blobs").resolve()
                if blobs not in roots:
                    roots.append(blobs)
                break
    return roots


def name_problem(name, *, plain: bool = False) -> str | None:
    """Why ``name`` is not a relative name inside a folder (None: it is); ``plain`` also
    refuses ``.`` and empty components (an index entry: one spelling per file)."""
    if not isinstance(name, str):
        return f"is not a file name ({type(name).__name__})"
    if not name or "\0" in name:
        return "is not a file name"
    if name.startswith(("/", "\\")) or os.path.isabs(name):
        return "is an absolute path"
    if len(name) > 1 and name[1] == ":":
        return "starts with a drive letter"
    if "\\" in name:
        return "holds a backslash"
    parts = name.split("/")
    if ".." in parts:
        return "climbs out with '..'"
    if plain and any(x in ("", ".") for x in parts):  # "./a", "a//b", "a/": one file, several spellings
        return "is not a plain relative name"
    return None


def stays_inside(folder: Path, p: Path) -> bool:
    """Whether ``p`` (a link, maybe; resolved as far as it exists) lies in :func:`read_roots`."""
    try:
        real = Path(p).resolve()
    except (OSError, RuntimeError):  # a link loop
        return False
    return any(real == r or r in real.parents for r in read_roots(folder))


def inside(folder: str | os.PathLike, name: str, *, named_by: str | None = None,
           plain: bool = False) -> Path:
    """``folder / name``, once it is known to stay in the folder; the one check every read
    on behalf of a model folder goes through.

    ``name`` must be a relative name (no ``..``, absolute path, drive letter or
    backslash; with ``plain``, no ``.`` or empty component either), and the file, when
    it is a link, must resolve inside the folder or, in a Hugging Face cache snapshot,
    into the same repository's ``blobs/``. Otherwise an
    :class:`UnsafePathError` naming ``named_by`` (the file and entry that named it, e.g.
    ``".../model.safetensors.index.json: weight_map entry 'x'"``) or the path. A file
    that does not exist is returned as is: the caller reports it missing.
    """
    folder = Path(folder)
    problem = name_problem(name, plain=plain)
    if problem:
        where = named_by or str(folder)
        raise UnsafePathError(f"{where}: {str(name)[:200]!r} {problem}; embedq reads only files "
                              "inside the model folder")
    path = folder / name
    if not stays_inside(folder, path):
        where = named_by or str(path)
        try:
            real = str(path.resolve())
        except (OSError, RuntimeError):
            real = "a link loop"
        raise UnsafePathError(f"{where}: {name!r} is a link leading out of the model folder "
                              f"(to {real}); refusing to read it")
    return path


def check_links(folder: str | os.PathLike, *, depth: int = 2) -> None:
    """Refuse a folder holding a link that leads out of it (see :func:`inside`), before
    the folder is handed to a library (transformers) that reads files by name from it:
    tokenizer files, generation_config.json, chat templates, subfolders."""
    folder = Path(folder)

    def walk(d: Path, rel: str, left: int) -> None:
        try:
            entries = sorted(d.iterdir())
        except OSError:
            return
        for p in entries:
            name = f"{rel}{p.name}"
            if p.is_symlink():
                inside(folder, name)
            if left > 0 and p.is_dir() and not p.is_symlink() and not p.name.startswith("."):
                walk(p, name + "/", left - 1)

    walk(folder, "", depth - 1)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through the one staging commit (format/staging.py)."""
    from embedq.format import staging
    try:
        staging.write_bytes(path, data)
    except OverlayError:
        raise
    except OSError as e:
        raise OverlayError(f"{path}: cannot write: {staging.reason(e)}") from e


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


def folder_files(folder: str | os.PathLike, outputs: tuple[str, ...] = ()) -> list[Path]:
    """The files of a model or overlay folder an output must never replace, ``--force`` or
    not: every file in it and its sub-folders (shards an index names there, ``.embedq/``'s
    backups), but those ending in one of ``outputs`` (a verb's earlier outputs, which
    ``--force`` may replace). Folder links are not followed."""
    found = []
    for root, _, names in os.walk(folder, onerror=lambda e: None):
        found += [Path(root) / n for n in names if not (outputs and n.endswith(outputs))]
    return found
