"""Running ``embedq`` as a real process under faults: kills, a full disk, read-only folders.

(Used by tests/test_faults.py, tests/onnx/test_onnx_faults.py, tests/gguf/test_gguf_faults.py.)

A kill is placed with ``EMBEDQ_TEST_KILL_AT=<point>:<n>`` (embedq/format/staging.py): the
``n``-th time the process reaches ``point`` it sends itself SIGKILL (or SIGINT), so every
machine interrupts at the same step. :func:`sweep` kills at every commit of a verb in turn.
Each run is a fork of a server that imported embedq once (tests/zygote.py): a real process,
without the 2-5 s of interpreter start and imports per run (tests/test_zygote.py checks it
ends as a fresh ``python -m embedq.cli`` does; ``EMBEDQ_TEST_FORK=0`` runs those instead).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from embedq.format.staging import leftover


def embedq(*args, kill_at: str | None = None, sig: str = "KILL", fsize: int | None = None,
           env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -m embedq.cli ARGS`` (what the console script runs), under the given fault:
    a fork of a server that imported embedq once (tests/zygote.py; ``EMBEDQ_TEST_FORK=0``:
    a fresh interpreter each run, as before)."""
    e = {**os.environ, **(env or {})}
    e.pop("EMBEDQ_TEST_KILL_AT", None)
    e.pop("EMBEDQ_DEBUG", None)
    base = dict(e)
    if kill_at:
        e.update(EMBEDQ_TEST_KILL_AT=kill_at, EMBEDQ_TEST_KILL_SIGNAL=sig)
    args = list(map(str, args))
    if os.environ.get("EMBEDQ_TEST_FORK", "1") != "0":
        return _forked(args, e, base, fsize, timeout)

    def pre():
        # a shell's background job starts with SIGINT ignored: give the child a foreground
        # run's disposition; RLIMIT_FSIZE makes writes past it fail with EFBIG (a full disk)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    return subprocess.run([sys.executable, "-m", "embedq.cli", *args], env=e,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=pre)


_SERVERS: dict[frozenset, subprocess.Popen] = {}
_ZYGOTE = Path(__file__).with_name("zygote.py")
_PER_RUN = ("PYTEST_CURRENT_TEST",)


def _server(base: dict[str, str]) -> subprocess.Popen:
    """The fork server for this import-time environment (started on first use; the least
    recently used one stops when a third is needed: each holds torch's imports in memory)."""
    # what a run cannot have read at import time is not the server's business
    key = frozenset((k, v) for k, v in base.items() if k not in _PER_RUN)
    p = _SERVERS.pop(key, None)
    if p is None or p.poll() is not None:
        while len(_SERVERS) >= 2:
            _stop(_SERVERS.pop(next(iter(_SERVERS))))
        # -c, not the script's path: sys.path[0] is then the working folder, as with -m
        # (tests/ first on the path would shadow packages by its folders' names)
        p = subprocess.Popen([sys.executable, "-c", f"import runpy; runpy.run_path({str(_ZYGOTE)!r}, "
                              "run_name='__main__')"], env=base, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, bufsize=1)
    _SERVERS[key] = p  # last: the most recently used
    return p


def _stop(p: subprocess.Popen) -> None:
    with contextlib.suppress(Exception):
        p.stdin.close()
        p.wait(timeout=10)


@atexit.register
def _stop_servers() -> None:
    for p in _SERVERS.values():
        _stop(p)


def _forked(args: list[str], env: dict, base: dict, fsize: int | None,
            timeout: int) -> subprocess.CompletedProcess:
    p = _server(base)
    p.stdin.write(json.dumps({"args": args, "env": env, "cwd": os.getcwd(), "fsize": fsize,
                              "timeout": timeout}) + "\n")
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"the fork server (tests/zygote.py) died (exit {p.wait()})")
    answer = json.loads(line)
    code, stdout, stderr = os.waitstatus_to_exitcode(answer["status"]), answer["out"], answer["err"]
    if answer["timed_out"]:
        raise subprocess.TimeoutExpired(["embedq", *args], timeout, stdout, stderr)
    return subprocess.CompletedProcess(["embedq", *args], code, stdout, stderr)


def tree(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path``, hidden ones included; {} if it is missing."""
    path = Path(path)
    if not path.exists():
        return {}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def leftovers(folder: Path) -> list[str]:
    """Names under ``folder`` that are embedq staging (a killed run's leftovers)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if any(leftover(part) for part in p.relative_to(folder).parts))


def without_leftovers(t: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in t.items() if not any(leftover(part) for part in Path(k).parts)}


# An in-place verb changes several files; config.json is its switch, committed last (after
# the overlay, its config and the index, which only gains entries), so a loader reads the
# old model until config.json says otherwise. The journal (.embedq/) lets the next run or
# `embedq remove` finish or undo the rest.
IN_PLACE_STAGE = ("embedq.safetensors", "quantization_config.json", "model.safetensors.index.json")


def loaded_view(t: dict[str, str]) -> dict[str, str]:
    """What decides which model a loader reads: all but leftover staging, the journal
    (``.embedq/``) and the files an in-place verb stages before its switch (config.json)."""
    return {k: v for k, v in without_leftovers(t).items()
            if not k.startswith(".embedq/") and k not in IN_PLACE_STAGE}


def one_error_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    """The process failed with exactly one ``embedq: error:`` line, last, and no traceback."""
    assert r.returncode not in (0, -9), (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("embedq: error:")]
    assert len(errs) == 1 and lines[-1] == errs[0], r.stderr
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert ".embedq-partial-" not in errs[0] and ".embedq-onnx-" not in errs[0], errs[0]
    for n in needles:
        assert n in errs[0], errs[0]
    return errs[0]


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` (a folder) read-only for this user, root included: ``chattr +i`` where the
    filesystem has it, else a read-only bind mount of itself, else skip with the reason."""
    path = Path(path)
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        try:
            yield
        finally:
            os.chmod(path, 0o755)
        return
    r = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if r.returncode == 0:
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        return
    m = subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)], capture_output=True, text=True)
    if m.returncode != 0:
        pytest.skip(f"cannot make {path} read-only for root: chattr +i: {r.stderr.strip()[:80]}; "
                    f"read-only bind mount: {m.stderr.strip()[:80]}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


def settled(t: dict[str, str]) -> dict[str, str]:
    # the lock file keeps a killed holder's pid; the flock itself died with it
    return {k: v for k, v in without_leftovers(t).items() if k != ".embedq/lock"}


def sweep(args, dest: Path, reset, old: dict[str, str], new: dict[str, str], *,
          point: str = "committed", extra=None, limit: int = 16, view=None,
          after_switch=None, stride: int = 1, also: tuple = ()) -> int:
    """Kill ``embedq ARGS`` at its 1st, 2nd, … ``point`` until a run completes; after each
    kill ``dest`` holds the ``old`` or the ``new`` files (leftover staging aside), and a
    rerun gives exactly ``new`` (no leftover). ``reset()`` restores the old state before
    each kill; ``extra(n)`` checks more; ``view(tree)`` is what is compared after a kill
    (default: all but leftover staging; in-place verbs: what a loader reads, see
    :func:`loaded_view`); ``after_switch(at)`` replaces the rerun where the kill came after
    the switch to the new state (a verb that refuses to run twice, e.g. an in-place patch
    of a patched graph) and must leave exactly ``new``. ``stride`` > 1 kills at every
    stride-th commit only, the first and the last always (a verb with many alike commits).
    ``also``: more trees a kill may leave (through ``view``), e.g. an in-place verb's
    original model between two overlays. Returns the number of points the verb has."""
    view = view or without_leftovers

    def kill_at(at: str) -> bool:
        """Kill there and check; False when the run completed before reaching it."""
        reset()
        r = embedq(*args, kill_at=at)
        if r.returncode == 0:
            assert tree(dest) == new
            return False
        assert r.returncode == -signal.SIGKILL, (at, r.stderr)
        now = view(tree(dest))
        assert now in (view(old), view(new), *map(view, also)), \
            (at, sorted(set(now.items()) ^ set(view(old).items()), key=str))
        if extra:
            extra(at)
        if settled(tree(dest)) == settled(new):
            return True  # killed after its last change: complete (a rerun is refused as after any run)
        if after_switch is not None and now == view(new):
            after_switch(at)
        else:
            r = embedq(*args)
            assert r.returncode == 0, (at, r.stderr)
        assert tree(dest) == new, (at, leftovers(dest))
        return True

    # first: killed with its first file staged and fsynced, before any rename (the largest
    # leftover), then at the commits
    assert kill_at("staged:1"), "staged:1 was never reached: the sweep killed nothing"
    tried = set()
    for n in range(1, limit + 1, stride):
        tried.add(n)
        if not kill_at(f"{point}:{n}"):
            assert n > 1, f"{point} was never reached: the sweep killed nothing"
            if n - 1 not in tried:  # the stride may have skipped the last commit
                return n - 1 if kill_at(f"{point}:{n - 1}") else n - 2
            return n - 1
    raise AssertionError(f"still killed at {point}:{limit}")
