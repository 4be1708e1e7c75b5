"""The one way embedq writes an output: stage under a recognisable name, fsync, rename.

Every file or folder a verb produces is first written as
``.<name>.embedq-partial-<pid>-<token>`` in the destination's folder (same filesystem,
so the final ``os.replace`` is atomic), fsynced, renamed to ``<name>``, and the folder
fsynced. An exception removes the staged file; a kill (nothing runs) leaves it, and the
next run's :func:`clean_leftovers` recognises it by its name and removes it.

The pid in the name is what lets a run tell its own and a concurrent run's staging (a
live pid: kept) from a killed run's (a dead pid: removed). A pid the system has since
reused only delays the removal to a later run; it never deletes live work.

Test hook: ``EMBEDQ_TEST_KILL_AT=<point>[:<n>]`` sends this process SIGKILL (or
``EMBEDQ_TEST_KILL_SIGNAL``, e.g. ``INT``) the ``n``-th time (default 1st) it reaches
``point`` (:data:`KILL_POINTS`), so tests interrupt at the same step on any machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import re
import secrets
import shutil
import signal
from pathlib import Path
from typing import Callable, Iterable, Iterator

from embedq.errors import OverlayError

TAG = ".embedq-partial-"
OLD_TAG = ".embedq-old-"
DIR_PREFIX = ".embedq-"  # staging folders of a step: .embedq-<kind>-<pid>-<token> (onnx export, demo)
# <.name><tag><pid>-<token>; older releases' names (…<pid>.partial, …embedq-tmp-<pid>,
# tempfile's .embedq-onnx-XXXXXXXX) are recognised too, so their leftovers go as well.
_OURS = re.compile(r"^\.(?P<name>.+)(?P<tag>\.embedq-partial-|\.embedq-old-)(?P<pid>\d+)-[0-9a-z]+$")
_DIR = re.compile(r"^\.embedq-(?P<kind>onnx|stage|demo)-(?P<pid>\d+)-[0-9a-z]+$")
_LEGACY = (re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.partial$"),
           re.compile(r"^\.(?P<name>.+)\.embedq-tmp-(?P<pid>\d+)$"),
           re.compile(r"^\.embedq-onnx-(?P<pid>)[0-9a-z_]{8}$"),
           re.compile(r"^\.embedq-probe-(?P<pid>\d+)$"))

KILL_ENV, KILL_SIGNAL_ENV = "EMBEDQ_TEST_KILL_AT", "EMBEDQ_TEST_KILL_SIGNAL"
KILL_POINTS = {
    "staged": "a staged file is written and fsynced, not yet renamed to its name",
    "committed": "a staged file was just renamed to its name (later files of the verb not yet)",
    "stage-dir": "a staging folder was just created (a step's scratch space)",
    "onnx-data": "onnx patch: the new data file is in place, the model not yet renamed",
    "export-float": "onnx export: the float model is exported, not yet patched",
}
_reached: dict[str, int] = {}

log = logging.getLogger("embedq")
# Where cleaned leftovers are announced: ``on_leftovers(folder, names)``; the CLI prints one line.
on_leftovers: Callable[[Path, list[str]], None] | None = None


def kill_point(point: str) -> None:
    """Kill this process here if the test environment names ``point``; else nothing."""
    at = os.environ.get(KILL_ENV)
    if not at:
        return
    name, _, nth = at.partition(":")
    if name not in KILL_POINTS or point not in KILL_POINTS:  # a typo would make a test vacuous
        raise RuntimeError(f"{KILL_ENV}={at!r}: points are {', '.join(KILL_POINTS)}")
    if name != point:
        return
    _reached[point] = _reached.get(point, 0) + 1
    if _reached[point] == int(nth or 1):
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get(KILL_SIGNAL_ENV, "KILL")))


def partial_path(path: Path, tag: str = TAG) -> Path:
    """A fresh staging name for ``path``, beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}{tag}{os.getpid()}-{secrets.token_hex(4)}")


def fsync_dir(path: Path) -> None:
    """fsync a folder (the rename in it is durable); nothing where that is unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(p: Path) -> None:
    """Remove a staged file or folder, whatever is left of it."""
    with contextlib.suppress(FileNotFoundError):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink()


def reason(e: OSError) -> str:
    return e.strerror or str(e) or type(e).__name__


def output_error(e: OSError, path: Path, staged: Iterable[Path]) -> OverlayError | OSError:
    """``e`` about a staging name (or none) as an error naming the output ``path``."""
    fn = getattr(e, "filename", None)
    if fn is None or any(str(fn) == str(s) or str(fn).startswith(str(s) + os.sep) for s in staged):
        return OverlayError(f"{path}: cannot write: {reason(e)}")
    return e


def renamed(e: BaseException, stage: Path, output: Path) -> BaseException:
    """``e`` with the staging path in its message said as the output the user named."""
    from embedq.errors import EmbedqError
    if isinstance(e, EmbedqError) and str(stage) in str(e):
        new = type(e)(str(e).replace(str(stage), str(output)))
        new.__dict__.update(e.__dict__)
        return new
    if isinstance(e, OSError):
        return output_error(e, output, [stage])
    return e


def commit(tmp: Path, path: Path) -> None:
    """fsync ``tmp`` (a file), rename it to ``path``, fsync the folder."""
    if not tmp.is_dir():
        fsync_file(tmp)
    kill_point("staged")
    os.replace(tmp, path)
    fsync_dir(path.parent)
    kill_point("committed")


@contextlib.contextmanager
def staged(path: str | os.PathLike, *, folder: bool = False) -> Iterator[Path]:
    """Yield a staging path for ``path``; on success it becomes ``path`` (see module doc).

    ``folder``: the staging path is a created, empty folder, renamed onto ``path`` (which
    must then not exist, or be empty; :func:`exchange` replaces a full one). An
    :class:`OSError` about the staging name becomes an ``OverlayError`` naming ``path``.
    """
    path = Path(path)
    tmp = partial_path(path)
    try:
        if folder:
            tmp.mkdir()
        yield tmp
        commit(tmp, path)
    except OSError as e:
        remove(tmp)
        err = output_error(e, path, [tmp])
        if err is e:
            raise
        raise err from e
    except BaseException:
        remove(tmp)
        raise


@contextlib.contextmanager
def staging_dir(parent: str | os.PathLike, kind: str, *, output: Path | None = None) -> Iterator[Path]:
    """A scratch folder ``parent/.embedq-<kind>-<pid>-<token>``, removed on the way out
    (a kill leaves it to :func:`clean_leftovers`); errors about it name ``output``."""
    d = Path(parent) / f"{DIR_PREFIX}{kind}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        d.mkdir()
        kill_point("stage-dir")
        yield d
    except OSError as e:
        err = output_error(e, Path(output or parent), [d])
        if err is e:
            raise
        raise err from e
    finally:
        remove(d)


def _renameat2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        f = libc.renameat2
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return f


def exchange(staged_dir: Path, path: Path) -> None:
    """Put folder ``staged_dir`` at ``path`` (which may hold an older output), atomically.

    Linux swaps the two in one ``renameat2(RENAME_EXCHANGE)``; elsewhere ``path`` moves to
    ``.<name>.embedq-old-<pid>-*`` first, and a kill between the two renames is undone by
    the next run's :func:`clean_leftovers` (it moves the old output back).
    """
    if not path.exists():
        os.replace(staged_dir, path)
    else:
        f = _renameat2()
        at_cwd, exchange_flag = -100, 2
        if f is not None and f(at_cwd, os.fsencode(staged_dir), at_cwd, os.fsencode(path), exchange_flag) == 0:
            remove(staged_dir)  # now the old output
        else:
            old = partial_path(path, OLD_TAG)
            os.replace(path, old)
            os.replace(staged_dir, path)
            remove(old)
    fsync_dir(path.parent)


def _alive(pid: str) -> bool:
    if not pid:
        return False
    pid_i = int(pid)
    if pid_i == os.getpid():
        return True
    try:
        os.kill(pid_i, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid_i < 2 ** 22  # another user's process (an absurd pid is not one)
    return True


def leftover(name: str) -> tuple[str | None, str, bool] | None:
    """``(output name or None, pid, is_old)`` when ``name`` is a staging name of embedq."""
    m = _OURS.match(name)
    if m:
        return m["name"], m["pid"], m["tag"] == OLD_TAG
    m = _DIR.match(name)
    if m:
        return None, m["pid"], False
    for rx in _LEGACY:
        m = rx.match(name)
        if m:
            return m.groupdict().get("name"), m["pid"], False
    return None


def clean_leftovers(folder: str | os.PathLike, names: Iterable[str] | None = None) -> list[str]:
    """Remove what killed embedq runs left in ``folder`` and return the names removed.

    ``names``: only staging files of these outputs (staging folders always). A killed
    run's ``embedq-old`` copy whose output is missing is moved back, not removed.
    Announced through :data:`on_leftovers` (one line in the CLI).
    """
    folder = Path(folder)
    want = set(names) if names is not None else None
    try:
        entries = sorted(folder.iterdir()) if folder.is_dir() else []
    except OSError:
        return []
    gone = []
    for p in entries:
        what = leftover(p.name)
        if what is None:
            continue
        out, pid, old = what
        if (out is not None and want is not None and out not in want) or _alive(pid):
            continue
        try:
            if old and out and not (folder / out).exists():
                os.replace(p, folder / out)  # killed between the two renames of exchange()
                continue
            remove(p)
        except OSError:
            continue  # a read-only folder: left for a run that can
        gone.append(p.name)
    if gone:
        fsync_dir(folder)
        announce(folder, gone)
    return gone


def announce(folder: Path, names: list[str]) -> None:
    """Say (once, through :data:`on_leftovers` or the log) what was removed from ``folder``."""
    if on_leftovers is not None:
        on_leftovers(Path(folder), list(names))
    else:
        log.info("removed leftovers of an interrupted run in %s: %s", folder, ", ".join(names))


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through :func:`staged`."""
    path = Path(path)
    with staged(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
