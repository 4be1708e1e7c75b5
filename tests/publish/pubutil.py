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
    """A running :class:`fakehub.FakeHub`; this process's huggingface_hub points at it
    (endpoint, LFS instead of Xet, token, no backoff sleeps)."""
    import time
    import types

    from huggingface_hub import constants
    import huggingface_hub.utils._http as hf_http

    from fakehub import TOKEN, FakeHub

    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        # http_backoff retries a dropped connection 5 times with 1..8 s sleeps.
        fast = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
        fast.sleep = lambda s: None
        monkeypatch.setattr(hf_http, "time", fast)
        yield hub


def hub_env(hub, tmp_path) -> dict:
    """Environment for a subprocess that talks to ``hub``."""
    import os

    from fakehub import TOKEN
    env = dict(os.environ)
    env.update(HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1", HF_TOKEN=TOKEN,
               HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1")
    return env
