"""Every native kernel row on ONE prepared layout, interleaved: which row is fastest where.

The dispatch table (embedq/kernels/dispatch.py) picks one row per activation dtype and M;
this times the candidates side by side on the same table bytes, with bf16 and float32
``F.linear`` as the baseline, so a switch point by M is measured, not guessed. Synthetic
table of a real head shape (Gemma 3 270M by default), medians of ``-n`` interleaved rounds
(starting path rotated each round), the CPU and the load average printed.

    PYTHONPATH=. python scripts/bench_routes.py --schemes int8g64 q4g32 --batches 1 2 8 256
    PYTHONPATH=. python scripts/bench_routes.py --kernels native_bf16 native_avx512f#bf16

``KERNEL#bf16`` feeds a float32 kernel bf16 activations (its conversion timed too).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import cpu_model, load, parse_scheme, quantize_table, synthetic_table, timed_rounds  # noqa: E402

from embedq.kernels import dispatch  # noqa: E402
from embedq.kernels.prepared import PreparedTable  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", nargs="+", default=["int8g64", "q4g32"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 8, 16, 64, 256])
    ap.add_argument("--rows", type=int, default=262_144)
    ap.add_argument("--cols", type=int, default=640)
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--kernels", nargs="+", default=["native_bf16", "native_avx512f", "native_avx2"])
    a = ap.parse_args(argv)
    w = synthetic_table(a.rows, a.cols)
    w32 = w.float()
    hidden = torch.randn(max(a.batches), a.cols, generator=torch.Generator().manual_seed(1))
    fns = {"bf16": (torch.bfloat16, lambda x: F.linear(x, w)), "f32": (torch.float32, lambda x: F.linear(x, w32))}
    rows = {}
    for r in dispatch.ROUTES:  # the general row of each kernel name (no M limit)
        if r.m_max is None and r.m_min == 1 and r.act == "exact":
            rows.setdefault(r.kernel, r)
    for s in a.schemes:
        p = PreparedTable.from_table(quantize_table(w, parse_scheme(s)), dtype=torch.bfloat16)
        for k in a.kernels:
            name, _, feed = k.partition("#")
            r = rows[name]
            why = r.lib.unavailable() if r.lib is not None else None
            if why or not isinstance(p.layout, r.layout):
                print(f"   {s}:{k} not timed: {why or 'another layout'}")
                continue
            # bf16-only rows (native_bf16, native_amx) take bf16; the others float32 unless #bf16
            dt = torch.bfloat16 if torch.float32 not in r.acts or feed == "bf16" else torch.float32
            fns[f"{s}:{k}"] = (dt, lambda x, r=r, p=p: r.run(p.layout, x))
    print(f"{cpu_model()}, {torch.get_num_threads()} threads, {a.rows} x {a.cols}, load avg {load()}")
    for m in a.batches:
        xs = {dt: hidden[:m].to(dt).contiguous() for dt in (torch.bfloat16, torch.float32)}
        ts = timed_rounds({k: (lambda _x, f=f, dt=dt: f(xs[dt])) for k, (dt, f) in fns.items()}, None, a.n, a.n, set())
        med = {k: statistics.median(v) * 1e3 for k, v in ts.items()}
        best = min(med["bf16"], med["f32"])
        print(f"-- M = {m}: median of {a.n} (ms, ÷ best float), load avg {load()}")
        for k, v in med.items():
            print(f"   {k:28s} {v:8.1f}  {v / best:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
