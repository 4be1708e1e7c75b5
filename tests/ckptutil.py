"""Checkpoint helpers for tests (a uniquely named module: sub-suites have their own conftest)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def snapshot(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (relative names)."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).rglob("*")) if p.is_file()}
