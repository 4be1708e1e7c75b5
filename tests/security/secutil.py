"""Helpers for the untrusted-folder tests (tests/security): CLI runs, tampering."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, example, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from embedq.cli import app
from embedq.errors import EmbedqError
from embedq.format.digest import digest_for, hexdigest

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def run_cli(*args):
    """``(exit code, output, exception)`` of one in-process CLI run."""
    res = runner.invoke(app, [str(a) for a in args])
    out = res.stdout + (res.stderr if res.stderr_bytes is not None else "")
    return res.exit_code, out, res.exception


def assert_refused(res, *needles):
    """One line ``embedq: error: ...`` naming ``needles``, exit 2, no traceback."""
    code, out, exc = res
    assert code == 2, (code, out, exc)
    assert exc is None or isinstance(exc, SystemExit), repr(exc)
    err = [ln for ln in out.splitlines() if ln.startswith("embedq: error:")]
    assert len(err) == 1, out
    for n in needles:
        assert n in err[0], err[0]
    assert "Traceback" not in out
    return err[0]


def cli_subprocess(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "embedq.cli", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def tree(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (hidden ones included); links as ``-> target``."""
    out = {}
    for p in sorted(Path(path).rglob("*")):
        rel = str(p.relative_to(path))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def read_qconfig(folder: Path) -> dict:
    return json.loads((folder / "quantization_config.json").read_text())


def write_qconfig(folder: Path, cfg) -> None:
    """Write a (maybe malformed) config where readers look: the file, and config.json's copy."""
    (folder / "quantization_config.json").write_text(json.dumps(cfg))
    if (folder / "config.json").exists():
        c = json.loads((folder / "config.json").read_text())
        if isinstance(c.get("quantization_config"), dict):
            c["quantization_config"] = cfg
            (folder / "config.json").write_text(json.dumps(c))


def tamper_overlay(folder: Path, fn, *, fix_checksums: bool = True) -> None:
    """Rewrite ``embedq.safetensors`` with ``fn(tensors)`` applied, keeping its metadata,
    and (like a careful attacker) update the recorded checksums to match."""
    file = folder / "embedq.safetensors"
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(file))
    fn(tensors)
    file.unlink()
    save_file(tensors, str(file), metadata=meta)
    if not fix_checksums:
        return
    cfg = read_qconfig(folder)
    for entry in cfg["modules"].values():
        for k in list(entry.get("checksums") or {}):
            if k in tensors:
                entry["checksums"][k] = hexdigest(  # the config's own digest
                    tensors[k].contiguous().view(torch.uint8).numpy(), digest_for(cfg["format_version"]))
    write_qconfig(folder, cfg)


def set_source_row(folder: Path, tensor: str, row: int, value: float) -> None:
    """Put ``value`` into one row of a source tensor of a single-file checkpoint."""
    file = folder / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    t = load_file(str(file))
    t[tensor][row, 3] = value
    file.unlink()
    save_file(t, str(file), metadata=meta)


# --- the fuzz suites (test_fuzz_safetensors.py, test_fuzz_config_json.py, test_fuzz_onnx.py):
# one harness, counts printed at the end. Every example ends in success or one
# ``embedq: error:`` line (an EmbedqError from the Python API), never a traceback, and leaves
# the source folder as it was; their pristine folders are conftest.py's ``made``.

FUZZ_COUNTS: dict[str, dict[str, int]] = {}


def begin(test: str) -> None:
    """Count one fuzz example of ``test``."""
    count(test, "")


def count(test: str, outcome: str) -> None:
    """Record one fuzz example's outcome; tests/security/conftest.py prints the table."""
    d = FUZZ_COUNTS.setdefault(test, {})
    d[outcome] = d.get(outcome, 0) + 1


def ends_cleanly(*args) -> tuple[bool, str]:
    """Run the CLI; it must succeed or print one ``embedq: error:`` line (exit 2), never a
    traceback. ``(succeeded, output)``."""
    import traceback
    code, out, exc = run_cli(*args)
    if exc is not None and not isinstance(exc, SystemExit):
        raise AssertionError(f"embedq {' '.join(map(str, args))}: traceback\n"
                             + "".join(traceback.format_exception(exc)))
    assert "Traceback" not in out, out
    if code == 0:
        return True, out
    assert code == 2, (code, out)
    errs = [ln for ln in out.splitlines() if ln.startswith("embedq: error:")]
    assert len(errs) == 1, out
    return False, out


def examples(*cases):
    """Each case as an explicit hypothesis example (run on top of the generated ones), so
    that every kind of mutation is tried in every run."""
    def deco(test):
        for c in reversed(cases):
            test = example(m=c)(test)
        return test
    return deco


FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 65), max_value=2 ** 65),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=10))
json_value = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=3),
                                                          st.dictionaries(st.text(max_size=6), c, max_size=3)),
                          max_leaves=5)


def _copy(src: Path, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("fz") / src.name
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _in_place(test: str, folder: Path, *extra) -> None:
    """``quantize`` in place: refused with the folder unchanged, or done, verified, and
    removed again, restoring every file."""
    before = tree(folder)
    ok, _ = ends_cleanly("quantize", folder, "-q", *extra)
    count(test, "quantize ok" if ok else "quantize refused")
    if not ok:
        assert tree(folder) == before
        return
    ends_cleanly("verify", folder)
    ok, out = ends_cleanly("remove", folder)
    assert ok, out
    assert tree(folder) == before


def _python_api(test: str, fn, *args) -> bool:
    """Success, or an :class:`EmbedqError` with a one-line message."""
    try:
        fn(*args)
    except EmbedqError as e:
        assert "\n" not in str(e), str(e)
        count(test, f"{fn.__name__} refused")
        return False
    count(test, f"{fn.__name__} ok")
    return True
