"""Fixtures and helpers for the publishing tests.

(Not a conftest.py: a second conftest module would shadow tests/conftest.py for the
``from ckptutil import snapshot`` imports of the top-level tests. Test modules import
the fixtures they use from here.)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest


def snapshot(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path``, hidden ones included (relative names)."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).rglob("*")) if p.is_file()}


@pytest.fixture
def derive(model_factory, tmp_path):
    """``derive(kind, name="out", **quantize_kwargs)`` -> (source folder, output folder)."""
    import embedq

    def make(kind: str, name: str = "out", source: Path | None = None, **kw):
        src = source or model_factory(kind)
        out = tmp_path / name
        report = embedq.quantize(src, kw.pop("bits", 8), output=out, progress=False, **kw)
        return src, out, report

    return make


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """A running :class:`fakehub.FakeHub` (tests/fakehub.py) this process's huggingface_hub
    points at, with the token it accepts."""
    from fakehub import TOKEN, FakeHub, point_at

    with FakeHub() as hub:
        yield point_at(hub, monkeypatch, tmp_path, TOKEN)


def hub_env(hub, tmp_path) -> dict:
    """Environment for a subprocess that talks to ``hub``."""
    import os

    from fakehub import TOKEN
    env = dict(os.environ)
    env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_TOKEN=TOKEN, HF_HUB_OFFLINE="0",
               HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1")
    return env
