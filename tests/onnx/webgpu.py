"""WebGPU EP runs for the tests: scripts/setup_webgpu.sh's environment, one worker process
per run (tests/onnx/webgpu_worker.py), placement from ORT's profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import clients
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("webgpu_worker.py")
_ENV: dict | None = None


def webgpu_env() -> dict:
    """The process environment of scripts/setup_webgpu.sh (run once; idempotent, cached).

    A failing set-up is a skip off CI and a failure under CI (tests/clients.py)."""
    global _ENV
    if _ENV is None:
        env_file = clients.setup("scripts/setup_webgpu.sh", "ORT WebGPU EP (SwiftShader)")
        out = subprocess.run(["bash", "-c", f'. "{env_file}" && env -0'], capture_output=True,
                             check=True, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        env = dict(x.split("=", 1) for x in out.stdout.decode().split("\0") if "=" in x)
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(REPO)])
        _ENV = env
    return _ENV


@dataclass
class Run:
    outputs: dict
    placement: dict  # node name -> [op type, provider]
    error: str | None
    seconds: float | None
    tokens: list | None

    def on(self, op: str) -> dict[str, str]:
        """node name -> provider of every node of type ``op``."""
        return {n: p for n, (o, p) in self.placement.items() if o == op}

    def fallbacks(self) -> dict[str, str]:
        """node name -> op type of the nodes that ran on the CPU EP."""
        return {n: o for n, (o, p) in self.placement.items() if p != "WebGpuExecutionProvider"}


def run(model: Path, feeds: dict, tmp: Path, ep: str = "webgpu", ep_options: dict | None = None,
        greedy: int = 0, timeout: float = 1800) -> Run:
    tmp.mkdir(parents=True, exist_ok=True)
    tag = f"{ep}-{len(list(tmp.glob('spec-*.json')))}"
    np.savez(tmp / f"in-{tag}.npz", **feeds)
    spec = {"model": str(model), "inputs": str(tmp / f"in-{tag}.npz"), "out": str(tmp / f"out-{tag}.npz"),
            "ep": ep, "ep_options": ep_options or {}, "greedy": greedy}
    (tmp / f"spec-{tag}.json").write_text(json.dumps(spec))
    p = subprocess.run([sys.executable, str(WORKER), str(tmp / f"spec-{tag}.json")], env=webgpu_env(),
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"webgpu worker failed (rc {p.returncode}):\n{p.stderr[-4000:]}"
    res = json.loads(p.stdout.strip().splitlines()[-1])
    outs = dict(np.load(spec["out"])) if res["error"] is None else {}
    return Run(outs, res["placement"], res["error"], res["seconds"], res["tokens"])
