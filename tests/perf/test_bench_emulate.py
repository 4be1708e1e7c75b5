"""scripts/bench_serve.py --emulate: the float baseline is capped like embedq's kernels
(the machinery, with the timing helpers tested here, is in scripts/benchlib.py).

torch's float32 F.linear is MKL's sgemm where torch is built with MKL, and MKL ignores
ONEDNN_MAX_CPU_ISA: without MKL_ENABLE_INSTRUCTIONS the "AVX2" float32 baseline ran AVX-512
on an AMX Xeon (Gemma head M = 256: 390 vs 521 ms) and every AVX2 ratio was too high.
"""

from __future__ import annotations

import importlib.util
import platform
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchlib.py"
PROBE = """
import torch
from embedq.kernels import build
a = torch.randn(64, 64)
a @ a
print("ATEN", torch.backends.cpu.get_cpu_capability())
print("EMBEDQ", ",".join(sorted(build.cpu_flags())))
print("MKL", torch.backends.mkl.is_available())
"""


def _benchlib():
    spec = importlib.util.spec_from_file_location("benchlib", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the emulated families are x86 ones")
def test_emulated_avx2_caps_embedq_aten_and_mkl():
    mod = _benchlib()
    env = mod.emulated_env("avx2")
    env["MKL_VERBOSE"] = "1"
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.split(" ", 1)[0] in
                 ("ATEN", "EMBEDQ", "MKL"))
    assert lines["ATEN"] in ("AVX2", "DEFAULT"), lines  # DEFAULT: a CPU below AVX2
    assert not any(f.startswith("avx512") or f.startswith("amx") for f in lines["EMBEDQ"].split(",")), lines
    if lines["MKL"] == "True":  # MKL says which ISA it dispatched to in its verbose header
        header = next(line for line in (r.stdout + r.stderr).splitlines() if line.startswith("MKL_VERBOSE oneMKL"))
        assert "AVX-512" not in header and "AMX" not in header, header


def test_every_family_caps_every_float_library():
    mod = _benchlib()
    for family in mod.EMULATE:
        env = mod.emulated_env(family)
        for var in ("EMBEDQ_CPU_FEATURES", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS"):
            assert env[var], (family, var)


def test_cold_rounds_flush_before_every_timed_call():
    """--cold: the evicting read runs before every timed call of every path (not in the
    warm-up), and is sized from the L3 this machine reports."""
    bl = _benchlib()
    calls = []

    class Spy(bl.Evict):
        def __call__(self):
            calls.append("evict")
            super().__call__()

    ev = Spy(1 << 20)
    fns = {"a": lambda x: calls.append("a"), "b": lambda x: calls.append("b")}
    times = bl.timed_rounds(fns, None, 3, 3, set(), ev)
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert calls[:2] in (["a", "b"], ["b", "a"])  # the warm-up, not flushed
    timed = calls[2:]
    assert len(timed) == 12 and all(timed[i] == "evict" and timed[i + 1] != "evict" for i in range(0, 12, 2))
    if Path("/sys/devices/system/cpu/cpu0/cache/index3/size").exists():
        assert bl.l3_bytes() >= 1 << 20
    assert bl.Evict(0).buf is None  # no cache size known: warm rounds


def test_steal_time_is_a_percentage():
    """The steal time printed beside each batch (a neighbour's burst on the host)."""
    bl = _benchlib()
    t0 = bl.cpu_ticks()
    sum(range(10**6))
    assert 0.0 <= bl.steal_since(t0) <= 100.0
    if Path("/proc/stat").exists():
        assert t0[1] > 0


def test_paired_ratio_survives_a_burst_that_two_medians_do_not():
    """A host burst slows every path of the rounds it hits: the ratio within a round holds."""
    mod = _benchlib()
    base = [10.0, 10.0, 10.0, 20.0, 20.0, 20.0, 20.0]  # rounds 3-6 in a burst: everything 2x
    mine = [5.0, 5.0, 5.0, 10.0, 10.0, 10.0, 10.0]
    pr, q1, q3 = mod.paired_ratio(mine, base)
    assert (pr, q1, q3) == (0.5, 0.5, 0.5)
    # slow paths ran the first rounds only: paired with the baseline's same rounds
    assert mod.paired_ratio([30.0, 30.0], base)[0] == 3.0
    assert mod.paired_ratio([7.0], base) == (0.7, 0.7, 0.7)


def test_read_floor_reads_every_held_tensor():
    """S-read: a plain read of every tensor the prepared table holds (the memory floor printed
    beside the kernels), whatever their sizes."""
    import torch
    from embedq.kernels import PreparedTable
    bl = _benchlib()
    w = torch.randn(37, 96).to(torch.bfloat16)
    for name in ("q4g32a", "int8"):
        p = PreparedTable.from_table(bl.quantize_table(w, bl.parse_scheme(name)))
        lay = p.layout
        held = [getattr(lay, n) for n in lay.holds if getattr(lay, n) is not None]
        out = bl.read_floor(p)(None)
        assert len(out) == len(held) >= 2
        assert sum(t.numel() * t.element_size() for t in held) == p.nbytes
        for o, t in zip(out, held):
            b = t.contiguous().view(torch.uint8).reshape(-1)
            want = b.view(torch.int64).sum() if b.numel() % 8 == 0 else b.amax()
            assert torch.equal(o, want)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the emulated families are x86 ones")
def test_emulated_avx512f_without_vnni_drops_vnni():
    """Skylake-SP (AVX-512F, no VNNI): embedq's rows that need VNNI are taken away too."""
    from embedq.kernels import build
    if "avx512f" not in build.cpu_flags():
        pytest.skip("this CPU has no AVX-512F to emulate a Skylake-SP with")
    env = _benchlib().emulated_env("avx512f_novnni")
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    flags = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.startswith("EMBEDQ "))["EMBEDQ"]
    flags = set(flags.split(","))
    assert "avx512f" in flags and not flags & {"avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"}, flags
