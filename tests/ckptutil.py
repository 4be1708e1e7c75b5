"""Checkpoint helpers for tests (a uniquely named module: sub-suites have their own conftest)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def snapshot(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (relative names)."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).rglob("*")) if p.is_file()}


# The CLI's bad-input contract, shared by the bad-input test files: one `embedq: error:` line,
# no traceback.

def run_cli(*args) -> tuple[int, str]:
    """``embedq ARGS`` in-process: (exit code, stdout + stderr)."""
    from typer.testing import CliRunner
    from embedq.cli import app
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res.exit_code, res.stdout + (res.stderr if res.stderr_bytes is not None else "")


def assert_one_line_error(code, out, *needles):
    """A non-zero exit whose output holds exactly one error line, naming every needle."""
    assert code != 0, out
    err = [ln for ln in out.splitlines() if ln.startswith("embedq: error:")]
    assert len(err) == 1, out
    for n in needles:
        assert n in err[0], err[0]
    assert "Traceback" not in out


def refused(res, *words):
    """A CliRunner result refused as bad input: exit 2, the output one error line naming
    every word, no traceback, not an 'unexpected' error."""
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("embedq: error: "), res.output
    assert "Traceback" not in res.output and "unexpected" not in res.output
    for w in words:
        assert w in lines[0], lines[0]
