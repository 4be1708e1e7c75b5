"""The stage profile (EMBEDQ_PROFILE / --profile) and the finite check's cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import embedq
from embedq.quant.profile import Profile
from tests.perf.test_chunking import _checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_profile_stages_add_up_to_the_process_cpu(tmp_path):
    ck = _checkpoint(tmp_path / "m", 4096, 512)  # 2 x 4 MiB tables: the threaded pipeline
    dest = tmp_path / "profile.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), EMBEDQ_PROFILE=str(dest))
    r = subprocess.run([sys.executable, "-m", "embedq.cli", "quantize", str(ck), "--lm-head",
                        "--bits", "4", "--chunk-rows", "256", "-q", "--json"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)  # the report on stdout stays JSON; the table goes to stderr
    assert "embedq profile" in r.stderr and "process CPU" in r.stderr
    p = json.loads(dest.read_text())
    stages = {(row["thread"], row["stage"]) for row in p["rows"]}
    for want in [("MainThread", "kernel: quantize + pack + stats"), ("embedq-read", "read: hash source"),
                 ("embedq-write", "write: pwrite"), ("MainThread", "target discovery + tie check")]:
        assert want in stages, want
    assert any(s.startswith("start-up") for _, s in stages)
    assert p["coverage"] >= 0.95, p
    total = sum(row["cpu_s"] for row in p["rows"])
    assert total == pytest.approx(p["process_cpu_s"], rel=0.05)


def test_cli_profile_flag(tmp_path, monkeypatch):
    ck = _checkpoint(tmp_path / "m", 256, 256)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("EMBEDQ_PROFILE", None)
    r = subprocess.run([sys.executable, "-m", "embedq.cli", "quantize", str(ck), "--profile", "-q"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "embedq profile" in r.stderr and "named stages" in r.stderr


def test_nested_stages_count_once():
    p = Profile()
    p.enabled, p.dest = True, None
    with p.stage("outer"):
        with p.stage("inner"):
            sum(i * i for i in range(200_000))
    rows = {s: r for (_, s), r in p.rows.items()}
    assert rows["inner"][0] > rows["outer"][0] >= 0  # outer's self time excludes inner


def test_finite_tables_skip_the_full_finite_pass(tmp_path, monkeypatch):
    """RTN refuses NaN/inf from the kernel's statistics: no extra pass over finite chunks."""
    import embedq.jobs.overlay as ov
    calls = []
    real = ov.check_finite
    monkeypatch.setattr(ov, "check_finite", lambda *a: calls.append(a) or real(*a))
    ck = _checkpoint(tmp_path / "m", 700, 256)
    embedq.quantize(ck, 4, lm_head=True, chunk_rows=64, progress=False)
    assert calls == []


@pytest.mark.parametrize("kernel", ["native", "eager", "float16"])
@pytest.mark.parametrize("bits,group,sym", [(8, None, True), (4, 32, False)])
@pytest.mark.parametrize("value,word", [(float("nan"), "NaN"), (float("inf"), "an infinity")])
def test_non_finite_row_is_named_from_the_statistics(tmp_path, monkeypatch, kernel, bits, group, sym,
                                                     value, word):
    """Every kernel's statistics flag the chunk (native C; eager reference; float16 tables,
    which the native kernel does not read), and the exact check names the row."""
    from safetensors.torch import load_file, save_file

    from embedq.quant.stream import NonFiniteSource
    if kernel == "eager":
        monkeypatch.setenv("EMBEDQ_COMPILE", "0")
    ck = _checkpoint(tmp_path / "m", 700, 256)
    t = load_file(str(ck / "model.safetensors"))
    if kernel == "float16":
        t = {k: v.to(torch.float16) for k, v in t.items()}
    t["lm_head.weight"][389, 17] = value
    save_file(t, str(ck / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NonFiniteSource, match=f"row 389 holds {word}") as e:
        embedq.quantize(ck, bits, group_size=group or 0, symmetric=sym, lm_head=True, chunk_rows=64,
                        progress=False)
    assert "lm_head.weight" in str(e.value) and e.value.row == 389
    assert not (ck / "embedq.safetensors").exists()


def test_huge_finite_values_are_not_refused(tmp_path, monkeypatch):
    """Finite values whose squares overflow float32 make the statistics infinite: the exact
    check then runs on that chunk alone, clears it, and the value is stored."""
    from safetensors.torch import load_file, save_file

    import embedq.jobs.overlay as ov
    checked = []
    real = ov.check_finite
    monkeypatch.setattr(ov, "check_finite", lambda x, r0, *a: checked.append((r0, x.shape[0])) or real(x, r0, *a))
    ck = _checkpoint(tmp_path / "m", 256, 256)
    t = load_file(str(ck / "model.safetensors"))
    t["model.embed_tokens.weight"][3, 3] = 3e38  # bf16 holds it; its square overflows float32
    save_file(t, str(ck / "model.safetensors"), metadata={"format": "pt"})
    embedq.quantize(ck, 8, group_size=0, chunk_rows=64, progress=False)
    assert checked == [(0, 64)]  # the suspect chunk only, not the whole table
    got = embedq.load_overlay(ck).table_for("model.embed_tokens").dequantize(torch.float32)
    assert got[3, 3] == pytest.approx(3e38, rel=2 ** -7)  # per-row int8: the row max is exact up to the bf16 scale
    assert embedq.verify(ck).modules
