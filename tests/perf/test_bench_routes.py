"""scripts/bench_routes.py runs (a tiny table): every kernel row that runs here is timed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from embedq.kernels import dispatch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_routes.py"


def test_bench_routes_times_every_row_that_runs_here(capsys):
    spec = importlib.util.spec_from_file_location("bench_routes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kernels = ["native_bf16", "native_avx512f", "native_avx2", "native_portable"]
    assert mod.main(["--rows", "1000", "--cols", "64", "--schemes", "q4g32", "--batches", "1", "3", "-n", "1",
                     "--kernels", *kernels]) == 0
    out = capsys.readouterr().out
    assert "-- M = 1:" in out and "-- M = 3:" in out
    for k in kernels:
        lib = next(r.lib for r in dispatch.ROUTES if r.kernel == k)
        # a timed row prints its ms; a row that cannot run here prints "not timed: <reason>"
        timed = re.search(rf"q4g32:{k}\s+[0-9.]+\s", out) is not None
        assert timed == (lib.unavailable() is None), (k, lib.unavailable(), out)
