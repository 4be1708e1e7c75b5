"""The CPU-checkable parts of the GPU benchmark (scripts/bench_gpu.sh, scripts/bench_gpu.py):
argument handling, the step plan, the refusal without a GPU, and a --dry-run of the head
section under Triton's interpreter (needs Triton: the vLLM venv)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SH = REPO / "scripts" / "bench_gpu.sh"
PYSCRIPT = REPO / "scripts" / "bench_gpu.py"


def _mod():
    spec = importlib.util.spec_from_file_location("bench_gpu", PYSCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sh(*args):
    return subprocess.run(["bash", str(SH), *args], capture_output=True, text=True, timeout=60)


def test_sh_plan_and_arguments():
    r = _sh("--plan", "--out", "/tmp/x.json")
    assert r.returncode == 0, r.stderr
    assert "setup_vllm_venv.sh" in r.stdout and "make_gemma3_fixture.py" in r.stdout
    assert "pytest tests/gpu/test_triton.py" in r.stdout
    assert "bench_gpu.py --json /tmp/x.json" in r.stdout and "--dry-run" not in r.stdout
    r = _sh("--dry-run", "--skip-tests", "--plan", "--", "-n", "3")
    assert r.returncode == 0
    assert "pytest" not in r.stdout and "make_gemma3_fixture" not in r.stdout
    assert "--dry-run --section head -n 3" in r.stdout
    r = _sh("--skip-engine", "--plan")
    assert "--section head" in r.stdout
    r = _sh("--bogus")
    assert r.returncode == 2 and "unknown argument --bogus" in r.stderr
    assert _sh("--out").returncode == 2
    assert _sh("--help").returncode == 0


def test_py_arguments():
    m = _mod()
    a = m.parse_args([])
    assert a.batches == [1, 16, 64, 256] and a.engine_batches == [1, 64]
    assert a.schemes == ["int8", "int8g64", "q4g32"] and a.section == ["head", "engine"]
    assert (a.n, a.reps) == (7, 10)
    assert m.SHAPES["27b"] == (248_320, 5_120) and m.SHAPES["gemma270m"] == (262_144, 640)
    d = m.parse_args(["--dry-run"])
    assert d.section == ["head"] and (d.n, d.reps) == (2, 1)
    assert m.target_of("int8", 1) == 0.6 and m.target_of("q4g32", 16) == 0.35
    assert m.target_of("q4g32", 256) == 1.0 and m.target_of("int8", 64) is None
    with pytest.raises(SystemExit):
        m.parse_args(["--batches", "0"])
    with pytest.raises(SystemExit):
        m.parse_args(["--schemes", "q3"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_py_refuses_without_gpu(tmp_path):
    r = subprocess.run([sys.executable, str(PYSCRIPT), "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "no CUDA device" in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed (the dry run needs its interpreter; vLLM venv)")
def test_py_dry_run(tmp_path):
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, str(PYSCRIPT), "--dry-run", "--shapes", "27b", "--schemes", "q4g32",
                        "int8", "--batches", "1", "17", "-n", "1", "--workdir", str(tmp_path),
                        "--json", str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "DRY RUN" in r.stdout and "-> triton on cpu" in r.stdout
    rows = json.loads(out.read_text())
    assert {(x["scheme"], x["batch"], x["path"]) for x in rows} == {
        (s, m, p) for s in ("q4g32", "int8") for m in (1, 17) for p in ("bf16", "triton", "dequant")}
    assert all(x["dry_run"] and x["rel_error"] < 1e-3 for x in rows)
