#!/usr/bin/env python
"""Serving-speed benchmark: quantized head (and later whole-model decode) vs bf16.

Head section (``--section head``): synthetic random tables of real head shapes, one
forward of the head (logits = x @ W^T) per call, bf16 activations; every path is timed
interleaved in the same loop (round-robin, starting path rotated each round) so that
load from other processes on the machine hits all paths alike; medians, ratios to
``bf16`` and the load average are printed.

Paths per scheme ``S`` (``--schemes``, e.g. ``int8 q4g32 int8a q4g32a int8g32``):
  bf16        F.linear with the bf16 table (the baseline)
  S           embedq.format.fastpath.PreparedTable.linear (the fast path)
  S-ref       today's back-end path: backends.transformers.QuantizedLMHead (chunked dequant)

    PYTHONPATH=. python scripts/bench_serve.py --shapes gemma270m --batches 1 8 64 -n 15

Later sections (whole-model transformers / vLLM decode tokens/s) plug into SECTIONS.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedq.format.fastpath import PreparedTable  # noqa: E402
from embedq.quant.rtn import quantize_rtn  # noqa: E402
from embedq.format.scheme import Scheme  # noqa: E402
from embedq.format.codec import QuantizedTable  # noqa: E402

SHAPES = {
    "gemma270m": (262_144, 640),   # Gemma 3 270M head
    "27b": (248_320, 5_120),       # a 27B-class head
    "small": (32_768, 512),        # quick smoke runs
}


def parse_scheme(name: str) -> Scheme:
    m = re.fullmatch(r"(int8|q4)(?:g(\d+))?(a)?", name)
    if not m:
        raise SystemExit(f"bad scheme {name!r} (int8, int8a, int8g32, q4g32, q4g32a, q4 ...)")
    bits = 8 if m.group(1) == "int8" else 4
    g = int(m.group(2)) if m.group(2) else None
    return Scheme(bits=bits, symmetric=m.group(3) is None, group_size=g)


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def synthetic_table(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """A bf16 table with per-row magnitudes spread like real embeddings (generated in chunks)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.empty(rows, cols, dtype=torch.bfloat16)
    step = max(1, (1 << 24) // cols)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        w[a:b] = (torch.randn(b - a, cols, generator=g) * 0.02
                  * torch.exp(0.3 * torch.randn(b - a, 1, generator=g))).to(torch.bfloat16)
    return w


def quantize_table(w: torch.Tensor, scheme: Scheme) -> QuantizedTable:
    """Quantize row chunks (bounded float32 temporaries) into one QuantizedTable."""
    rows, cols = w.shape
    step = max(1, (1 << 22) // cols)
    packed, scales, zps = [], [], []
    for a in range(0, rows, step):
        q, s, zp = quantize_rtn(w[a:a + step], scheme, torch.bfloat16)
        part = QuantizedTable.from_codes(q, s, zp, scheme.bits, scheme.group_size)
        packed.append(part.packed)
        scales.append(s)
        if zp is not None:
            zps.append(zp)
    return QuantizedTable(torch.cat(packed), torch.cat(scales), torch.cat(zps) if zps else None,
                          scheme.bits, scheme.group_size, (rows, cols))


def reference_head(qt: QuantizedTable):
    """Today's transformers back-end head over the same tensors."""
    from embedq.backends.transformers import PackedTable, QuantizedLMHead
    rows, cols = qt.shape
    t = PackedTable(rows, cols, qt.bits, qt.group_size, qt.symmetric, qt.scale.dtype, device="cpu")
    t.load_from(qt.packed, qt.scale, torch.tensor([rows, cols]), qt.packed_zero_point())
    return QuantizedLMHead(t)


def timed_rounds(fns: dict, x: torch.Tensor, n: int, n_slow: int, slow: set) -> dict[str, list[float]]:
    """Round-robin timing; paths in ``slow`` run only in the first ``n_slow`` rounds."""
    names = list(fns)
    times = {k: [] for k in names}
    with torch.inference_mode():
        for k in names:  # warm-up (first-call allocations, lazy init)
            fns[k](x)
        for r in range(n):
            order = names[r % len(names):] + names[:r % len(names)]
            for k in order:
                if k in slow and r >= n_slow:
                    continue
                t0 = time.perf_counter()
                fns[k](x)
                times[k].append(time.perf_counter() - t0)
    return times


def bench_head(args) -> list[dict]:
    results = []
    for shape_name in args.shapes:
        rows, cols = SHAPES[shape_name]
        print(f"\n== head {shape_name}: {rows} x {cols}  (load avg {load()})", flush=True)
        w = synthetic_table(rows, cols)
        fns = {"bf16": lambda x, w=w: F.linear(x, w)}
        slow = set()
        for sname in args.schemes:
            qt = quantize_table(w, parse_scheme(sname))
            p = PreparedTable.from_table(qt, dtype=torch.bfloat16)
            print(f"   {sname}: {p.describe()}, {p.nbytes / 2**20:.1f} MiB "
                  f"(overlay {qt.nbytes() / 2**20:.1f} MiB, bf16 {w.numel() * 2 / 2**20:.1f} MiB)", flush=True)
            fns[sname] = p.linear
            if not args.no_ref:
                fns[f"{sname}-ref"] = reference_head(qt)
                slow.add(f"{sname}-ref")
            del qt
            gc.collect()
        for m in args.batches:
            x = torch.randn(m, cols, dtype=torch.bfloat16)
            la0 = load()
            times = timed_rounds(fns, x, args.n, args.n_ref, slow)
            base = statistics.median(times["bf16"])
            print(f"-- batch {m}: median of {args.n} ({args.n_ref} for -ref); load avg {la0} -> {load()}")
            for k, ts in times.items():
                med = statistics.median(ts)
                print(f"   {k:14s} {med * 1e3:9.1f} ms  {med / base:6.2f}x bf16   "
                      f"(min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f}, n={len(ts)})", flush=True)
                results.append(dict(section="head", shape=shape_name, rows=rows, cols=cols, batch=m,
                                    path=k, median_ms=med * 1e3, ratio_vs_bf16=med / base,
                                    n=len(ts), loadavg_before=la0, loadavg_after=load()))
        del w, fns
        gc.collect()
    return results


# Whole-model sections (transformers generate, vLLM decode tokens/s) go here.
SECTIONS = {"head": bench_head}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", nargs="+", default=["head"], choices=sorted(SECTIONS))
    ap.add_argument("--shapes", nargs="+", default=["gemma270m"], choices=sorted(SHAPES))
    ap.add_argument("--schemes", nargs="+", default=["int8", "q4g32"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("-n", type=int, default=15, help="rounds (median over them)")
    ap.add_argument("--n-ref", type=int, default=3, help="rounds for the slow reference paths")
    ap.add_argument("--no-ref", action="store_true", help="skip today's (slow) reference path")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, load avg {load()}")
    results = []
    for s in args.section:
        results += SECTIONS[s](args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
