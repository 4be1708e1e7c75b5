"""The real clients the suite drives (ORT's WebGPU EP, transformers.js, node-llama-cpp,
onnxruntime-genai, optimum's exporter, the aarch64 toolchain): one rule for a client that
cannot be set up.

Off CI a developer without Node or apt sees a skip naming the step. Under ``CI=true`` or
``EMBEDQ_REQUIRE_CLIENTS=1`` (scripts/test.sh sets it) the same case is a failing test: a
green run must mean every client really ran, not that its install broke."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("EMBEDQ_CACHE") or Path.home() / ".cache" / "embedq")


def required() -> bool:
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("EMBEDQ_REQUIRE_CLIENTS") == "1"


def unavailable(client: str, reason: str, log: Path | None = None) -> NoReturn:
    """Skip (a developer's machine) or fail (CI, scripts/test.sh): ``client`` is not usable."""
    msg = f"{client} could not be set up: {reason}" + (f" (its log: {log})" if log else "")
    if required():
        pytest.fail(f"required client missing: {msg} [CI=true or EMBEDQ_REQUIRE_CLIENTS=1]", pytrace=False)
    pytest.skip(msg)


def setup(script: str, client: str) -> str:
    """Run a set-up script (repo-relative, idempotent, cached); its last stdout line.

    Its stderr goes to ``$EMBEDQ_CACHE/logs/<script name>.test.log``; a failure names the
    script, its last error line and that log."""
    path = REPO / script
    p = subprocess.run(["bash", str(path)], capture_output=True, text=True)
    if p.returncode:
        log = CACHE / "logs" / f"{path.stem}.test.log"
        try:
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
        except OSError:
            log = None
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        unavailable(client, f"{script} exited {p.returncode}: {last}", log)
    return p.stdout.strip().splitlines()[-1]
